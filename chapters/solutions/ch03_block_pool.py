"""Reference solution, chapter 03: BlockPool.allocate and free with reference counts."""

from minivllm.core.block_pool import BlockPool


class MyBlockPool(BlockPool):
    def allocate(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # the least recently freed block
        block = self.blocks[block_id]
        if block.block_hash is not None:  # it still held a cached prefix: that is about to be overwritten
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block_id

    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:  # its last reader is gone
            self.free_queue[block_id] = None  # to the back: a cached prefix stays longest
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)  # nothing worth keeping: reused first
