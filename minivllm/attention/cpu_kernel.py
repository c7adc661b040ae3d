"""The CPU fast path of the torch backend: cpu_paged_attention.cpp, built by torch's cpp_extension at first use.

Why C++: the reference (torch_backend.py) copies each request's K/V blocks out of the cache into a padded
tensor and masks the padding; on CPU that copy and the masked SDPA were over a quarter of a decode step. The
kernel reads the blocks in place. It is compiled once per machine (10-25 s, `-O3 -march=native`), in one build
with the fused layer ops (minivllm/cpu_extension.py), into torch's extension cache.
MINIVLLM_CPU_ATTENTION=reference keeps the reference; without a compiler the reference stays too, after a warning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from minivllm import envs
from minivllm.attention.metadata import AttentionMetadata
from minivllm.logger import init_logger

logger = init_logger(__name__)
Kernel = Callable[..., torch.Tensor]  # kernel(q, k_cache, v_cache, meta, scale, k=None, v=None), below


def wanted() -> bool:
    """The fast path is on unless MINIVLLM_CPU_ATTENTION=reference."""
    return envs.MINIVLLM_CPU_ATTENTION == "kernel"


@functools.cache  # one build (or one failure) per process; torch caches the build itself across processes
def load_kernel() -> Kernel | None:
    """The compiled kernel as `kernel(q, k_cache, v_cache, meta, scale, k=None, v=None)`, or None (with a warning)
    if it cannot be built here. Given k and v (this step's keys and values), it first stores them at
    meta.slot_mapping, as store_kv does: one op per layer instead of store_kv's handful."""
    from minivllm import cpu_extension

    reason = cpu_extension.build_failure()  # one build with the other CPU sources (minivllm/cpu_extension.py)
    if reason is not None:  # no compiler, no headers, a failed build: the reference still works
        logger.warning("CPU paged-attention kernel unavailable, using the torch reference: %s", reason)
        return None
    op = torch.ops.minivllm_cpu.paged_attention
    # its output's shape, for torch.compile (which can then trace a model through the op without a graph break);
    # the schema marks the caches as written
    torch.library.register_fake("minivllm_cpu::paged_attention")(lambda q, *rest: q.new_empty(q.shape))

    def kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        slots = meta.slot_mapping
        if k is None:  # attend only: nothing new to store
            k = v = k_cache.new_empty(0, *k_cache.shape[2:])
            slots = slots[:0]
        return op(q, k, v, k_cache, v_cache, slots, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)

    return kernel


def fits(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor | None = None,
         v: torch.Tensor | None = None) -> bool:
    """What the kernel handles: CPU tensors, a cache in the query's dtype (an fp8 cache takes the reference), and
    no padded rows; new keys and values (if given) in the cache's dtype, their last dim contiguous."""
    new_kv_fit = k is None or all(x.dtype == k_cache.dtype and x.stride(-1) == 1 for x in (k, v))
    return (q.device.type == "cpu" and k_cache.dtype == q.dtype and q.stride(-1) == 1
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and k_cache.is_contiguous()
            and sum(meta.query_lens_cpu) == q.shape[0] and new_kv_fit)
