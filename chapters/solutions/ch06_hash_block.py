"""Reference solution, chapter 06: the chained name of a full block."""

import hashlib
from array import array


def my_hash_block(parent_hash, token_ids) -> bytes:
    digest = hashlib.sha256(parent_hash or b"")  # the parent's name first: the chain
    digest.update(array("q", token_ids).tobytes())  # 8 bytes per id: [1, 23] and [12, 3] differ
    return digest.digest()
