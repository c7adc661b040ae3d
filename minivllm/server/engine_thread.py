"""EngineThread: the one thread that builds an engine and runs every one of its steps.

Why one thread, and why the same one that loaded the model: the CPU kernels split their work over
OpenMP threads, and OpenMP (libgomp, torch's on Linux) gives every thread that starts a parallel
region a team of workers of its own. A server that loads the model on its main thread and then
steps on another holds two teams, and the stepping team runs slower: its workers wait for a core
and hand over later at every one of the thousands of parallel regions in a step. Measured on the
2-core machine of bench/RESULTS.md (64 requests of 128 prompt and 128 output tokens, fp32): 199
tok/s stepping on the thread that loaded the model, 137 stepping on another, 210 when a second
thread both loads and steps. The event loop on the main thread then does no parallel work at all:
HTTP, JSON and queues only.

It is also the rule that keeps LLMEngine correct: the engine is not thread-safe, and this thread
is the only one that touches it after `build`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A single worker thread: `build` (blocking) and `run` (awaitable) call functions on it."""

    def __init__(self, name: str = "minivllm-engine") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def build(self, fn: Callable[..., T], *args: Any) -> T:
        """Call `fn(*args)` on the thread and wait for it (an engine's construction): its error,
        if any, is raised here, in the caller."""
        return self._pool.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Await `fn(*args)` on the thread (one step) while the event loop serves others."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Let the thread end once its current call returns (shutdown)."""
        self._pool.shutdown(wait=False)
