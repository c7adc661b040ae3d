"""What the CPU can do and how much of it is free: the default dtype, and how many threads to use.

Native bf16 instructions decide the CPU's default dtype (vLLM-CPU's rule): x86 reports `avx512_bf16` or
`amx_bf16` in /proc/cpuinfo's flags, Arm `bf16` in its features. Without them bf16 is emulated through fp32 and
is slower than fp32 itself, so "auto" stays fp32 there. CpuThreadSizer (below) sizes the threads.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.cache  # a fact about the hardware: read the file once per process
def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 dot products in hardware (AVX512-BF16, AMX, Arm BF16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # macOS, Windows: Apple silicon has bf16 but torch's CPU kernels there gain little from it
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return bool(flags & NATIVE_BF16_FLAGS) and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64")


def default_cpu_dtype() -> torch.dtype:
    """dtype="auto" on CPU: bf16 where the CPU has it natively, fp32 elsewhere.

    MINIVLLM_CPU_DTYPE=float32 (or bfloat16, float16) overrides the choice for a whole run: the test suite sets
    it to float32, because equality with transformers is exact only there (tests/test_cpu_bf16.py checks bf16);
    float16 runs on CPU what a learner on a GPU without bf16 (Colab's T4) gets, only slower.
    """
    override = os.environ.get("MINIVLLM_CPU_DTYPE")
    if override:
        if override not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"MINIVLLM_CPU_DTYPE must be 'float32', 'bfloat16' or 'float16', got {override!r}")
        return getattr(torch, override)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@functools.cache  # read before any sizer changes it: a later engine must not inherit a busy moment's count
def torch_default_threads() -> int:
    """torch's own thread count (its physical cores, or OMP_NUM_THREADS), capped by the CPUs we may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, torch.get_num_threads())


class CpuThreadSizer:
    """Sizes torch's intra-op threads to the cores other processes leave free, re-checked every `interval_s`.

    Why: an OpenMP thread that has to wait for a core taken by another process stalls every parallel region
    it is part of, while its partner spins. On the shared 2-core machine of bench/RESULTS.md, 2 threads at batch 1
    went from 27 ms to over 1 s per step when other jobs were running, while 1 thread took 40 ms. So every few
    seconds this reads how much CPU time the whole machine spent (/proc/stat) minus our own process's, and uses
    the cores that are left on the machine (at least 1, at most `max_threads`). Without /proc/stat it changes
    nothing.
    """

    def __init__(self, fixed: int | None = None, max_threads: int | None = None, interval_s: float = 2.0) -> None:
        """`fixed`: use exactly this many threads, never resized (EngineConfig.cpu_threads)."""
        self.max_threads = max_threads or torch_default_threads()
        self.interval_s = interval_s
        if fixed:
            torch.set_num_threads(fixed)
        self.threads = torch.get_num_threads()
        self._last = None if fixed else self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(wall seconds, machine busy CPU seconds, our process's CPU seconds), or None without /proc/stat."""
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(x) for x in fields]
        busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # all but idle and iowait
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()

    def update(self) -> int:
        """Call once per step: cheap until `interval_s` has passed. Returns the thread count in use."""
        if self._last is None or time.monotonic() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        wall, busy, ours = (a - b for a, b in zip(now, self._last))
        self._last = now
        others = max(0.0, (busy - ours) / wall)  # cores' worth of CPU the other processes used, machine-wide
        threads = max(1, min(self.max_threads, round((os.cpu_count() or 1) - others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
