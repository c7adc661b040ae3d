"""Slow subprocess work a few test modules need starts when collection ends, and those modules run last.

Building and installing a wheel and compiling its C++ kernels from an empty cache (test_install.py), ~730 Triton
kernels for three GPUs (test_aot_compile.py), or the GPU bench scripts at toy sizes (test_bench_scripts.py) keeps
a subprocess busy for a minute or more. pytest runs
in one process, and most tests keep one of the two cores busy, so that work can run beside the suite on the
other. A module opts in by defining `head_start(folder: Path)`: the plugin calls it in one background thread at
idle priority, one module after another, as soon as collection ends, and the module's fixtures take the
result with `head_start_result` (which waits for it, and re-raises what it raised). Its tests are moved to just
before the chapters, so the work has most of the suite's time to finish. Deselected modules start nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest


def _lowest_priority() -> None:
    """The background thread and every process it starts (Linux schedules threads, and children inherit the
    policy) run as SCHED_IDLE: only on a core nothing else wants, and preempted at once when a test's thread
    wakes. At normal priority, a compile beside a test that runs torch on two OpenMP threads made each parallel
    region wait for a descheduled thread, and a 5 s fixture took 106 s; nice 19 still let the background hold a
    core for a scheduler tick whenever a test's second thread woke."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest niceness where there is one
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (AttributeError, OSError):
            pass


class HeadStart:
    """The plugin (conftest.py registers it as "head-start"): the opted-in modules' work, started and kept."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.started: dict[str, Future] = {}
        self.folder: Path | None = None

    @staticmethod
    def _opted_in(item: pytest.Item) -> bool:
        return isinstance(item, pytest.Function) and hasattr(item.module, "head_start")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        late = [item for item in items if self._opted_in(item)]
        rest = [item for item in items if not self._opted_in(item)]
        chapters = next((i for i, item in enumerate(rest) if item.path.suffix == ".ipynb"), len(rest))
        items[:] = rest[:chapters] + late + rest[chapters:]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        modules = {item.module.__name__: item.module for item in session.items if self._opted_in(item)}
        if not modules or session.config.option.collectonly:
            return
        self.folder = Path(tempfile.mkdtemp(prefix="minivllm-head-start-"))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="head-start", initializer=_lowest_priority)
        for name, module in modules.items():
            folder = self.folder / name
            folder.mkdir()
            self.started[name] = self.pool.submit(module.head_start, folder)

    def result(self, module_name: str):
        if module_name not in self.started:
            raise RuntimeError(f"{module_name}'s head start never began (was it collected?)")
        return self.started[module_name].result()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)  # a running job ends by its own timeouts
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def head_start_result(request: pytest.FixtureRequest):
    """What the requesting module's `head_start(folder)` returned, once it has."""
    return request.config.pluginmanager.get_plugin("head-start").result(request.module.__name__)
