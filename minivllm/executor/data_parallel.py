"""Data parallelism's processes: engines 1..N-1, each a whole engine in its own process.

Tensor parallelism (workers.py) splits one model over processes that step together. Data
parallelism runs N whole engines, each with its own scheduler and KV cache, and gives each a share
of the requests: nothing passes between them while they run, so a plain pipe per engine carries
everything (a batch of requests in, its finished outputs back) and no process group is needed. The
weights are the only thing they share, and the kernel shares them: every engine maps the same
weight-cache file (model/weight_cache.py).

Engine 0 is the caller's own process (entrypoints/llm.py): it keeps the tokenizer, the metrics and
everything else an `LLM` offers, and a single-engine run pays for no extra process. This module
starts and watches the others; what each runs (`target`) comes from the engine layer above
(engine/data_parallel.py), as executor/ never imports the engine. A dead engine raises a
DataParallelError carrying its own traceback (sent on its pipe before it exits) or its exit code,
never a hang: every wait here also wakes when a process ends. Stopping is idempotent and also runs
when the handle is garbage-collected or the interpreter exits.
"""

from __future__ import annotations

import signal
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from minivllm.config import EngineConfig
from minivllm.executor.workers import reap, receive


class DataParallelError(RuntimeError):
    """A data-parallel engine process died or failed: the LLM cannot continue."""


class EngineProcesses:
    def __init__(self, config: EngineConfig,
                 target: Callable[[EngineConfig, int, Connection], None]) -> None:
        """Spawn engines 1..N-1 (N = config.data_parallel_size), each running
        `target(config, rank, conn)`; they load their model while the caller loads engine 0's."""
        self.size = config.data_parallel_size
        self.error: DataParallelError | None = None
        self.procs: list = []
        self.conns: list[Connection] = []
        self._stop = weakref.finalize(self, stop, self.procs, self.conns)
        ctx = mp.get_context("spawn")
        for rank in range(1, config.data_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, name=f"minivllm-dp-engine{rank}", daemon=True,
                               args=(config, rank, child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def ranks(self) -> range:
        return range(1, self.size)

    def send(self, rank: int, message: object) -> None:
        """Hand engine `rank` a message (a batch of requests); raises if it has died."""
        self.check()
        try:
            self.conns[rank - 1].send(message)
        except OSError as e:  # its end of the pipe is gone: it died
            raise self.fail() or DataParallelError(f"engine {rank}: {e}") from e

    def receive(self, rank: int, *kinds: str) -> tuple[str, object]:
        """Engine `rank`'s next report, (kind, payload), of one of `kinds`; waits until it comes or
        the engine dies (then its own error is raised)."""
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        wait([conn, proc.sentinel])
        message = receive(conn, 0)
        if message[0] not in kinds:
            unexpected = f"engine {rank} sent {message[0]!r}, not {' or '.join(kinds)}"
            raise self.fail({rank: message}) or DataParallelError(unexpected)
        return message

    def wait_for_death(self, cancel: Connection) -> bool:
        """Block until an engine process ends (True) or `cancel` becomes readable (False)."""
        if not self.procs:
            wait([cancel])
            return False
        ready = wait([cancel, *(p.sentinel for p in self.procs)])
        return cancel not in ready

    def check(self) -> None:
        """Raise the DataParallelError if an engine has died (cheap: exit codes), or stopped."""
        if self.error is None and any(_ended(p) for p in self.procs):
            self.fail()
        if self.error is not None:
            raise self.error
        if not self._stop.alive:
            raise DataParallelError("the data-parallel engines have been shut down")

    def fail(self, read: dict[int, tuple] | None = None) -> DataParallelError | None:
        """After something went wrong: the engines' own errors (None if all fine); all stopped.
        `read`: reports already taken off an engine's pipe (its error, perhaps)."""
        if self.error is None:
            reasons = []
            for rank, proc, conn in zip(self.ranks, self.procs, self.conns):
                proc.join(timeout=0.5)  # an engine that raised exits right after reporting it
                kind, text = (read or {}).get(rank) or _last_report(
                    conn, 0.5 if proc.exitcode is None else 0)
                if kind == "error":
                    reasons.append(f"data-parallel engine {rank} raised:\n{text}")
                elif _ended(proc):
                    code = proc.exitcode
                    reasons.append(f"data-parallel engine {rank} (pid {proc.pid}) exited" + (
                        "" if code is None else f" with code {code}{_signal_name(code)}"))
            if reasons:
                self.error = DataParallelError("a data-parallel engine failed; the LLM has "
                                               "stopped: " + "\n".join(reasons))
        self.shutdown(polite=False)
        return self.error

    def shutdown(self, polite: bool = True) -> None:
        """Stop every engine process (asked first, if `polite` and none failed; killed if it
        stays)."""
        if not polite or self.error is not None:
            self._stop.detach()
            stop(self.procs, self.conns, polite=False)
        self._stop()


def _last_report(conn: Connection, timeout_s: float) -> tuple[str, object]:
    """The error report a failing engine sent last, skipping any report before it."""
    message = receive(conn, timeout_s)
    while message[0] not in ("error", "died"):
        message = receive(conn, 0)
    return message


def _ended(proc) -> bool:
    """Whether an engine process has ended: its exit code, or (when something else reaped it, so
    that no exit code can be read) its sentinel."""
    return proc.exitcode is not None or bool(wait([proc.sentinel], 0))


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    try:
        return f" (killed by {signal.Signals(-exitcode).name})"
    except ValueError:
        return ""


def stop(procs: list, conns: list[Connection], polite: bool = True) -> None:
    """Ask the engines to leave (a None message), then kill any still there."""
    for conn in conns if polite else ():
        try:
            conn.send(None)
        except OSError:  # it went away meanwhile: nothing to ask
            pass
    reap(procs, conns, 5 if polite else 0.1)
