"""EngineProfiler: `LLM.start_profile()` / `stop_profile()` record the engine with torch.profiler.

As in vLLM, profiling is switched on by naming a directory in the environment (ours or vLLM's
variable); `stop_profile()` writes one Chrome-trace JSON file there (open it in ui.perfetto.dev)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from minivllm import envs

PROFILER_DIR_VARS = ("MINIVLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir() -> Path | None:
    """The trace directory named in the environment (ours first), or None."""
    for var in PROFILER_DIR_VARS:
        if envs.read(var):
            return Path(envs.read(var))
    return None


class EngineProfiler:
    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._prefix = "minivllm"
        self._dir = Path(".")
        self.last_trace: Path | None = None  # the file the last stop() wrote

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, profile_prefix: str | None = None) -> None:
        directory = profiler_dir()
        if directory is None:
            raise ValueError(f"profiling is off: set {PROFILER_DIR_VARS[0]} (or "
                             f"{PROFILER_DIR_VARS[1]}) to the directory the trace should go to, "
                             f"before calling start_profile()")
        if self._profile is not None:
            raise ValueError("start_profile() called twice: call stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prefix, self._dir = profile_prefix or "minivllm", directory
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True,
                                               with_stack=False)
        self._profile.__enter__()

    def stop(self) -> Path:
        if self._profile is None:
            raise ValueError("stop_profile() without start_profile()")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{self._prefix}.{os.getpid()}.{time.time_ns()}.pt.trace.json"
        profile.export_chrome_trace(str(path))
        self.last_trace = path
        return path
