"""SwapSpace: host (CPU) memory that takes a preempted request's KV blocks, so resuming it costs a copy, not a prefill.

Preemption by *recompute* throws a victim's blocks away and later prefills prompt + output again: FLOPs.
Preemption by *swap* copies the blocks that hold its computed tokens to host memory and, when it is scheduled
again, copies them back into fresh GPU blocks: bytes over PCIe, and its `num_computed_tokens` survives.

Like the GPU pool, this only decides block ids: a host `BlockPool` (no prefix caching) and a host block table
per swapped request. The scheduler puts the resulting (src, dst) pairs in `SchedulerOutput.blocks_to_swap_out`
/ `blocks_to_swap_in`, and the runner moves `kv_cache[:, :, src]` to and from its host tensor before the
forward pass. When the host pool is full, the scheduler falls back to recompute (vLLM V0 raised instead).

The mode is explicit (`EngineConfig.preemption_mode`), not vLLM V0's automatic rule (swap only groups of
several sequences, such as beam search, whose shared blocks recompute could not restore cheaply): which one
wins depends on context length, link bandwidth and FLOPs, and chapter 11 runs one workload both ways to
measure it. Beams here survive recompute (their forks are computed afresh), so no rule is needed for them.
"""

from __future__ import annotations

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.request import Request


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks) if num_blocks > 0 else None
        self.tables: dict[str, list[int]] = {}  # swapped request id -> its host blocks, in logical order
        self.num_swapped_out = 0  # blocks copied to the host, over the engine's life
        self.num_swapped_in = 0

    @property
    def num_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_free_blocks

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.tables

    def swap_out(self, kv: KVCacheManager, request: Request) -> list[tuple[int, int]] | None:
        """Copy out the blocks holding the request's computed tokens and free all its GPU blocks.

        Returns the (gpu, host) pairs to copy, or None (nothing changed) when the host pool is too small.
        """
        rid = request.request_id
        used = kv.block_tables.get(rid, [])[: kv.blocks_needed(request.num_computed_tokens)]
        if self.pool is None or not used or len(used) > self.pool.num_free_blocks:
            return None
        pending = {dst: src for src, dst in kv.copies}  # a copy-on-write not yet done: its source has the data
        pairs = [(pending.get(gpu, gpu), self.pool.allocate()) for gpu in used]
        self.tables[rid] = [host for _, host in pairs]
        kv.events += [("swap_out", rid, gpu) for gpu in used]
        kv.free(request)  # after the copy the GPU blocks are free; a hashed one stays in the prefix cache
        self.num_swapped_out += len(pairs)
        return pairs

    def swap_in(self, kv: KVCacheManager, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh GPU blocks for a swapped request's host blocks, plus room for `num_new_tokens` more.

        Returns the (host, gpu) pairs to copy, or None (nothing changed) when the GPU pool is short.
        """
        rid = request.request_id
        host = self.tables[rid]
        if kv.blocks_needed(request.num_computed_tokens + num_new_tokens) > kv.num_free_blocks:
            return None
        table = kv.block_tables.setdefault(rid, [])
        for _ in host:
            table.append(kv.pool.allocate())
            kv.events.append(("swap_in", rid, table[-1]))
        pairs = list(zip(host, table))
        self.free(request)
        kv.register_computed_blocks(request)
        assert kv.allocate(request, num_new_tokens)  # checked above: the rest fits
        self.num_swapped_in += len(pairs)
        return pairs

    def free(self, request: Request) -> None:
        """Give back a request's host blocks (swapped in again, or aborted while swapped out)."""
        for host in self.tables.pop(request.request_id, []):
            self.pool.free(host)
