"""Timing on a GPU: the two measurements the kernel benchmarks and chapter 08 both need."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median milliseconds of fn on the GPU, by CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + written per second, the practical memory ceiling."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / (time_ms(lambda: dst.copy_(src)) * 1e-3)
