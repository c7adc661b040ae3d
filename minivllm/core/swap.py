"""SwapSpace: host (CPU) memory for preempted KV blocks, so resuming costs a copy, not a prefill.

Preemption by *recompute* throws a victim's blocks away and later prefills prompt + output again:
FLOPs. Preemption by *swap* copies the blocks holding its computed tokens to host memory and, when
it is scheduled again, back into fresh GPU blocks: bytes over PCIe; `num_computed_tokens` survives.

Like the GPU pool, this only decides block ids: a host `BlockPool` (no prefix caching) and a host
block table per swapped sequence. The GPU side goes through the KV-cache manager (`swap_out`,
`swap_in`), the only writer of its tables. The scheduler puts the (src, dst) pairs in
`SchedulerOutput.blocks_to_swap_out` / `blocks_to_swap_in`, and the runner moves the blocks
(BlockCopier, runner/memory.py) before the forward pass. When the host pool is full, the scheduler
falls back to recompute (vLLM V0 raised instead).

The mode is explicit (`EngineConfig.preemption_mode`), not vLLM V0's automatic rule (swap only
groups of sequences, such as beams, whose shared blocks recompute could not restore cheaply): which
wins depends on context length, link bandwidth and FLOPs; chapter 11 measures one workload both
ways. Beams here survive recompute (their forks are computed afresh), so they need no rule.
"""

from __future__ import annotations

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sequence import Sequence


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks) if num_blocks > 0 else None
        self.tables: dict[str, list[int]] = {}  # swapped sequence id -> its host blocks, in order
        self.num_swapped_out = 0  # blocks copied to the host, over the engine's life
        self.num_swapped_in = 0

    @property
    def num_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_free_blocks

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.request_id in self.tables

    def swap_out(self, kv: KVCacheManager, seq: Sequence) -> list[tuple[int, int]] | None:
        """Copy out the blocks holding the sequence's computed tokens and free all its GPU blocks.
        Returns the (gpu, host) pairs to copy, or None (no change) if the host pool is short."""
        needed = kv.blocks_needed(seq.num_computed_tokens)
        if self.pool is None or not needed or not kv.block_tables.get(seq.request_id) or \
                needed > self.pool.num_free_blocks:
            return None
        pairs = [(gpu, self.pool.allocate()) for gpu in kv.swap_out(seq)]
        self.tables[seq.request_id] = [host for _, host in pairs]
        self.num_swapped_out += len(pairs)
        return pairs

    def swap_in(self, kv: KVCacheManager, seq: Sequence,
                num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh GPU blocks for a swapped sequence's host blocks, plus room for `num_new_tokens`.
        Returns the (host, gpu) pairs to copy, or None (no change) if the GPU pool is short."""
        host = self.tables[seq.request_id]
        fresh = kv.swap_in(seq, len(host), num_new_tokens)
        if fresh is None:
            return None
        pairs = list(zip(host, fresh))
        self.free(seq)
        self.num_swapped_in += len(pairs)
        return pairs

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's host blocks (swapped in again, or aborted while swapped out)."""
        for host in self.tables.pop(seq.request_id, []):
            self.pool.free(host)
