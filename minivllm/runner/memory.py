"""The runner's side of KV memory: how many blocks, the tensors that hold them, moving blocks.

On a GPU the cache gets what is left of `gpu_memory_utilization` after the weights and the
activation peak of the largest possible step, which a profiling run measures; on a CPU a fixed
budget. Either way no more blocks than the sequences could ever fill. Swap preemption adds a host
cache of `swap_space` GiB. The scheduler picks every block to move by id (core/swap.py,
copy-on-write); `BlockCopier` only copies them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_sizing import (
    gpu_kv_budget,
    max_useful_blocks,
    num_blocks_for_budget,
)
from minivllm.core.math_utils import cdiv
from minivllm.core.step_io import SchedulerOutput
from minivllm.distributed.parallel import local_kv_heads
from minivllm.quantization.kv_cache import as_bytes
from minivllm.runner.step_batch import StepRow, attention_metadata, prepare_inputs, to_device


def kv_cache_shape(config: EngineConfig, num_blocks: int) -> tuple[int, ...]:
    """[layers, K/V, blocks, block_size, kv_heads, head_dim]: a block id names the same slots in
    every layer (and on every tensor-parallel rank, each of which caches only its own KV heads).
    A hybrid model's first dimension is its groups' size: a block serves one group's layers
    (core/kv_groups.py)."""
    mc = config.model_config
    kv_heads = local_kv_heads(mc.num_kv_heads, config.tensor_parallel_size)
    return config.kv_groups.group_size, 2, num_blocks, config.block_size, kv_heads, mc.head_dim


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int,
                  profile: Callable[[], int], reserved_bytes: int = 0,
                  companion_bytes_per_block: int = 0) -> int:
    """`num_kv_blocks` if set; else as many as the budget holds, up to what sequences could fill.
    `reserved_bytes` and `companion_bytes_per_block`: what a draft model loaded after us will need
    (its weights, and a block of its own for each of ours), so that both fit the GPU."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type != "cuda" or config.kv_cache_memory_bytes:
        budget = config.cpu_kv_cache_bytes
        in_budget = num_blocks_for_budget(budget, bytes_per_block)
    else:
        torch.cuda.empty_cache()
        peak_extra = profile()
        free, total = torch.cuda.mem_get_info()
        budget = gpu_kv_budget(total, config.gpu_memory_utilization, total - free + peak_extra)
        in_budget = num_blocks_for_budget(budget - reserved_bytes,
                                          bytes_per_block + companion_bytes_per_block)
    return min(in_budget, max_useful_blocks(config.max_num_seqs, config.max_model_len,
                                            config.block_size) * config.kv_groups.num_groups)


def host_kv_cache(config: EngineConfig, dtype: torch.dtype, bytes_per_block: int,
                  pin: bool) -> torch.Tensor | None:
    """The host blocks for preemption by swap: `swap_space` GiB (pinned on CUDA, so copies use DMA),
    capped at the blocks the sequences could ever fill; `dtype` is the device cache's (fp8 blocks
    swap as they are). `empty`: pages are only touched when blocks land there."""
    if config.preemption_mode != "swap":
        return None
    num = min(num_blocks_for_budget(int(config.swap_space * 2**30), bytes_per_block),
              max_useful_blocks(config.max_num_seqs, config.max_model_len, config.block_size)
              * config.kv_groups.num_groups)
    return torch.empty(kv_cache_shape(config, num), dtype=dtype, pin_memory=pin)


@torch.inference_mode()
def profile_run(model, config: EngineConfig, cache_dtype: torch.dtype, device: torch.device) -> int:
    """A forward pass at the largest step size over a `cache_dtype` cache: its activation peak in
    bytes (0 off CUDA). The KV cache gets what is left after weights and this peak, so a full step
    can never run out."""
    n, mc = config.max_num_batched_tokens, config.model_config
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    groups = config.kv_groups
    cache = torch.zeros(kv_cache_shape(config, cdiv(n, config.block_size) * groups.num_groups),
                        dtype=cache_dtype, device=device)
    # one sequence spanning the whole cache
    row = StepRow([0] * n, list(range(cache.shape[2])), 0, n, all_logits=True)
    inputs = prepare_inputs([row], config.block_size, groups.num_groups)
    inputs.positions %= mc.max_position_embeddings
    inputs.logit_rows = list(range(n - min(n, config.max_num_seqs), n))  # the most a step samples
    hidden = model(to_device(inputs.input_ids, device), to_device(inputs.positions, device), cache,
                   attention_metadata(inputs, device, groups))
    model.compute_logits(hidden[inputs.logit_rows])
    del cache, hidden
    return torch.cuda.max_memory_allocated() - base if cuda else 0


class BlockCopier:
    def __init__(self, kv_cache: torch.Tensor, host_kv_cache: torch.Tensor | None,
                 bytes_per_block: int) -> None:
        self.kv_cache, self.host_kv_cache = kv_cache, host_kv_cache
        self.bytes_per_block = bytes_per_block
        self.swap_bytes = 0  # KV bytes copied between device and host cache, both ways summed
        self.swap_seconds = 0.0

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_kv_cache is None else self.host_kv_cache.shape[2]

    def run(self, sched: SchedulerOutput) -> None:
        """Swap-outs to the host first (their device blocks may be handed to someone else in this
        very step), then copy-on-write copies, then swap-ins back from the host."""
        if not (sched.blocks_to_swap_out or sched.blocks_to_copy or sched.blocks_to_swap_in):
            return
        start = time.perf_counter()
        cache, host = self.kv_cache, self.host_kv_cache
        for pairs, src_cache, dst_cache in ((sched.blocks_to_swap_out, cache, host),
                                            (sched.blocks_to_copy, cache, cache),
                                            (sched.blocks_to_swap_in, host, cache)):
            if pairs:
                src = torch.tensor([a for a, _ in pairs], device=src_cache.device)
                dst = torch.tensor([b for _, b in pairs], device=dst_cache.device)
                # fp8 blocks move as bytes: torch has no index_copy_ for fp8 on CPU
                blocks = as_bytes(src_cache).index_select(2, src).to(dst_cache.device)
                as_bytes(dst_cache).index_copy_(2, dst, blocks)
                if src_cache is not dst_cache:
                    self.swap_bytes += len(pairs) * self.bytes_per_block
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)
        self.swap_seconds += time.perf_counter() - start
