"""What the CPU can do and how much of it is free: the default dtype, and how many threads to use.

Native bf16 instructions decide the CPU's default dtype (vLLM-CPU's rule): x86 reports `avx512_bf16`
or `amx_bf16` in /proc/cpuinfo's flags, Arm `bf16` in its features. Without them bf16 is emulated
through fp32 and is slower than fp32 itself, so "auto" stays fp32 there. CpuThreadSizer (below)
sizes the threads; bind_cpu_threads pins them to cores where asked (MINIVLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path

import torch

from minivllm import envs

NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.cache  # a fact about the hardware: read the file once per process
def cpu_flags() -> frozenset[str]:
    """The CPU's flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # macOS, Windows
        return frozenset()
    return frozenset(flag for line in text.splitlines() if line.startswith(("flags", "Features"))
                     for flag in line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 dot products in hardware (AVX512-BF16, AMX, Arm BF16). Apple
    silicon has bf16 but reports no flags here: torch's CPU kernels there gain little from it."""
    machine_ok = platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64")
    return bool(cpu_flags() & NATIVE_BF16_FLAGS) and machine_ok


def default_cpu_dtype() -> torch.dtype:
    """dtype="auto" on CPU: bf16 where the CPU has it natively, fp32 elsewhere. MINIVLLM_CPU_DTYPE
    (float32, bfloat16, float16) overrides it for a whole run: the test suite sets float32, where
    equality with transformers is exact (tests/test_cpu_bf16.py checks bf16); float16 runs on CPU
    what a learner on a GPU without bf16 (Colab's T4) gets, only slower."""
    if envs.MINIVLLM_CPU_DTYPE:
        return getattr(torch, envs.MINIVLLM_CPU_DTYPE)
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@functools.cache  # read before any sizer changes it: a later engine must not inherit a busy count
def torch_default_threads() -> int:
    """torch's own count (its physical cores, or OMP_NUM_THREADS), capped by the CPUs we may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, torch.get_num_threads())


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]: the kernel's cpulist, as taskset and vLLM use."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def bind_cpu_threads(setting: str | None = None, idle_load: float = 0.5) -> list[int] | None:
    """Pin this process's threads to cores, by MINIVLLM_CPU_OMP_THREADS_BIND (vLLM's
    VLLM_CPU_OMP_THREADS_BIND): unset or "off" (the default): nothing; "auto": the cores we may run
    on, only while the machine is idle; a list ("0-7", "0,2,4,6"): those cores. Returns the cores
    bound to, or None. Why: an unpinned thread migrates between cores and leaves its cache behind,
    and two engines on one big machine should not trade cores. But pinning is only right when the
    cores are ours: on a shared machine a pinned thread cannot leave a busy core, and every parallel
    region waits for it (CpuThreadSizer's reason). "auto" calls the machine idle when its 1-minute
    load average is under `idle_load` (others use under half a core), else leaves placement to the
    OS and the sizer. Every thread that exists now is bound (the OpenMP workers too), later ones
    inherit the set, and torch's thread count is capped at its size. For one thread per core
    exactly, also start Python with OMP_PROC_BIND=close."""
    setting = (setting if setting is not None else envs.MINIVLLM_CPU_OMP_THREADS_BIND).strip()
    if setting in ("", "off") or not hasattr(os, "sched_setaffinity"):
        return None
    if setting == "auto":
        if os.getloadavg()[0] >= idle_load:
            return None
        cpus = sorted(os.sched_getaffinity(0))
    else:
        try:
            cpus = parse_cpu_list(setting)
        except ValueError:
            raise ValueError(f"MINIVLLM_CPU_OMP_THREADS_BIND must be off, auto or a CPU list like "
                             f"0-7, got {setting!r}") from None
    for task in Path("/proc/self/task").iterdir():  # sched_setaffinity(0): the calling thread only
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))
    return cpus


class CpuThreadSizer:
    """Sizes torch's intra-op threads to the cores other processes leave free, every `interval_s`.
    Why: an OpenMP thread that waits for a core taken by another process stalls every parallel
    region it is in, while its partner spins: on the shared 2-core machine of bench/RESULTS.md, 2
    threads at batch 1 went from 27 ms to over 1 s per step when other jobs ran (1 thread: 40 ms).
    So every few seconds this reads the CPU time the machine spent (/proc/stat) minus our process's,
    and uses the cores left (at least 1, at most `max_threads`); without /proc/stat it changes
    nothing."""

    def __init__(self, fixed: int | None = None, max_threads: int | None = None,
                 interval_s: float = 2.0) -> None:
        """`fixed`: use exactly this many threads, never resized (EngineConfig.cpu_threads)."""
        self.bound_cpus = bind_cpu_threads()  # opt-in pinning, once per engine
        self.max_threads = max_threads or torch_default_threads()
        if self.bound_cpus:
            self.max_threads = min(self.max_threads, len(self.bound_cpus))
        self.interval_s = interval_s
        if fixed:
            torch.set_num_threads(fixed)
        self.threads = torch.get_num_threads()
        self._last = None if fixed else self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(wall s, machine busy CPU s, our process's CPU s), or None without /proc/stat."""
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(x) for x in fields]
        # all but idle and iowait: steal too (the hypervisor running another machine on one of our
        # virtual cores stalls a parallel region as another process would; excluding it, the
        # embedded model made 1,726-1,911 tok/s against 2,114-2,699, alternating, on a shared VM)
        busy = sum(ticks) - sum(ticks[3:5])
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()

    def update(self) -> int:
        """Call once per step: cheap until `interval_s` has passed. Returns the threads in use."""
        if self._last is None or time.monotonic() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        wall, busy, ours = (a - b for a, b in zip(now, self._last))
        self._last = now
        others = max(0.0, (busy - ours) / wall)  # cores' worth of CPU the other processes used
        threads = max(1, min(self.max_threads, round((os.cpu_count() or 1) - others)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
