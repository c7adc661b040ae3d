"""BlockPool: the physical KV blocks, their reference counts, free queue and prefix-cache map.

A block id names one slot range of `block_size` tokens in *every* layer's K and V cache tensors. The
pool never touches tensors: it only decides which ids are in use, the way an OS page allocator hands
out frames.

Free blocks wait in an LRU queue. A freed block that holds a full, hashed block of some prompt keeps
its contents and its hash until it is handed out again, so a later request with the same prefix can
take it back (a prefix-cache hit). Blocks without a hash go to the front of the queue: they hold
nothing worth keeping, so they are reused first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minivllm.core.block_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached


class BlockPool:
    """Which of the `num_blocks` KV blocks are in use, by how many requests, and which still hold a
    cached prefix.

    Why reference counts and not an owner: with prefix caching (chapter 06) and beam search forks
    (chapter 11) several requests read one block, and it may be reused only when the last of them
    lets go. Why an ordered free queue and not a set: the order decides what is evicted, the least
    recently freed first, and blocks that hold no cached prefix go to its front, so a freed prefix
    lives as long as possible. Why ids and not tensors: the pool is bookkeeping only, the same for
    every layer and every device; the model runner turns ids into slots of the real cache.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        """Take the least recently freed block; if it still held a cached prefix, evict that."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Share a block (a prefix-cache hit): one more reader; out of the free queue if idle."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that a full block holds the tokens named by `block_hash` (first writer wins)."""
        if block_hash not in self.cached:
            self.blocks[block_id].block_hash = block_hash
            self.cached[block_hash] = block_id

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (only blocks no request is using may hold one)."""
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
