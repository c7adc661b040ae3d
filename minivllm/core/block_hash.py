"""Block hashes for prefix caching: a full block's name hashes its tokens *and* its parent's name.

Chaining makes a block's name stand for the whole prefix up to its end, so two requests share a
block only if everything before it is the same too. The hash is SHA-256 (as vLLM's `sha256` option):
with Python's `hash()` two different prefixes could share a name, and a request would silently read
another's K/V. A 256-bit collision is not a practical concern, so a hit needs no token-by-token
comparison.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]  # hash_block's shape


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The name of one full block: SHA-256 over the parent's name and this block's token ids."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        hash_fn: HashFn = hash_block) -> list[BlockHash]:
    """Append the names of the full blocks of `token_ids` not yet in `hashes`; returns `hashes`.
    Each full block is hashed once in a request's life: the list lives on the request, and only
    blocks that filled up since the last call are new. `hash_fn`: hash_block, or a learner's own
    (minivllm.hooks)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(hash_fn(hashes[-1] if hashes else None,
                              token_ids[i * block_size : (i + 1) * block_size]))
    return hashes
