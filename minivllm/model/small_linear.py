"""CPU fast path for a few rows at a time: decode steps' linear layers through model/cpu_small_linear.cpp.

Decoding a handful of requests multiplies every weight by a few rows: the step is as fast as the weights stream
from memory. oneDNN's linear primitive (packed_linear.py) reaches about half the machine's read bandwidth there;
this kernel, with each weight laid out once in the order it reads it, gets close to all of it (bench/RESULTS.md:
a 135M model's batch-1 bf16 matmuls about 1.6x faster). Past `SMALL_ROWS` rows oneDNN's blocked GEMM is faster,
so the unquantized linear method keeps both layouts of each weight and picks one per call: the price is a second
copy of the weights in memory (`layout_copy_bytes` counts it). Needs AVX-512 (and AVX512-BF16 for bf16); elsewhere,
without a compiler, or with MINIVLLM_CPU_SMALL_LINEAR=0, oneDNN alone serves every call.
"""

from __future__ import annotations

import functools

import torch

from minivllm import envs
from minivllm.cpu_platform import cpu_flags
from minivllm.logger import init_logger

logger = init_logger(__name__)

SMALL_ROWS = 8  # up to this many rows of x (tokens in the step) the kernel beats oneDNN here; measured crossover


def small_linear_applies(device: str | torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU with AVX-512, bf16 where it also has AVX512-BF16, and the kernel built (unless
    MINIVLLM_CPU_SMALL_LINEAR=0)."""
    flags = cpu_flags()
    return (torch.device(device).type == "cpu" and envs.MINIVLLM_CPU_SMALL_LINEAR
            and "avx512f" in flags
            and (dtype == torch.float32 or dtype == torch.bfloat16 and "avx512_bf16" in flags) and _load())


@functools.cache  # one build (or one failure) per process
def _load() -> bool:
    from minivllm.cpu_extension import build_failure

    reason = build_failure()
    if reason is not None:  # no compiler, no headers: oneDNN serves every call
        logger.warning("CPU small-batch linear kernel unavailable, using oneDNN for every call: %s", reason)
    return reason is None


def pack_small(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] -> tiles of 64 output rows, inputs outermost within a tile: the order small_linear reads."""
    return torch.ops.minivllm_cpu.pack_small_linear(weight.detach())


def small_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ W.T + b for x of a few rows, W as `pack_small` left it."""
    return torch.ops.minivllm_cpu.small_linear(x, packed, bias, out_features)
