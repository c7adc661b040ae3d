"""Rank 0's handle on its child processes: start them, hear from them, notice deaths, stop them.

`ChildProcesses` serves the tensor-parallel workers (`Workers`) and the data-parallel engines
(engine/data_parallel.py) alike: each child has a pipe to rank 0 for its reports and its last error
(a collective says only that a peer went away; the pipe says why), and a death raises that error,
never a hang. Stopping is idempotent and also runs when the handle is garbage-collected or the
interpreter exits (weakref.finalize), so no child outlives its engine. Tensor-parallel rendezvous is
a TCPStore that rank 0 opens on a port the OS picks (port 0), so two engines never collide.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.distributed.parallel import TensorParallel, connect
from minivllm.executor.worker import serve_steps, worker_main

HOST = "127.0.0.1"
# a collective waiting on a live but stuck rank gives up after this (a dead one fails at once)
TIMEOUT_S = 300.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or raised: the engine cannot continue."""


class ChildProcesses:
    """Processes 1..N-1 spawned by this one, each with a pipe on which it reports ("error",
    traceback) before it exits: a death raises `error_type` with that traceback or exit code."""

    def __init__(self, error_type: type[RuntimeError], what: str, polite: bool = True) -> None:
        """`what`: how messages name one process; `polite`: stopping first sends each a None
        message (its loop's end) and waits for it."""
        self.error_type, self.what = error_type, what
        self.error: RuntimeError | None = None
        self.procs: list = []
        self.conns: list[Connection] = []
        self.ranks = range(1, 1)
        # fail() may run in a step's thread and in a watcher at once: one reads the pipes and stops
        self._failing = threading.RLock()
        leave = functools.partial(_say_none, self.conns) if polite else None
        self._stop = weakref.finalize(self, stop, self.procs, self.conns, leave)

    def spawn(self, count: int, target: Callable, name: str, args: Callable[[int, Connection],
                                                                          tuple]) -> None:
        """Start processes 1..count-1, each running `target(*args(rank, its end of the pipe))`."""
        ctx = mp.get_context("spawn")
        self.ranks = range(1, count)
        for rank in self.ranks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, name=f"{name}{rank}", daemon=True,
                               args=args(rank, child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def send(self, rank: int, message: object) -> None:
        """Hand process `rank` a message on its pipe; raises if it has died."""
        self.check()
        try:
            self.conns[rank - 1].send(message)
        except OSError as e:  # its end of the pipe is gone: it died
            raise self.fail() or self.error_type(f"{self.what} {rank}: {e}") from e

    def wait_for_death(self, cancel: Connection) -> bool:
        """Block until a process ends (True) or `cancel` becomes readable (False).

        The sentinel, not /proc's "Z": a multi-threaded child killed by a signal shows its leader
        as a zombie while its other threads are still being torn down, and until the last one is
        gone the kernel reports no exit status and keeps the child's end of the sentinel open."""
        return cancel not in wait([cancel, *(p.sentinel for p in self.procs)])

    def receive(self, rank: int, *kinds: str) -> tuple[str, object]:
        """Process `rank`'s next report, (kind, payload), of one of `kinds`; waits until it comes
        or the process dies (then its own error is raised)."""
        with self._failing:  # (a watcher's fail() may have stopped them all: its error, then)
            self.check()
            proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        wait([conn, proc.sentinel])
        message = receive(conn, 0)
        if message[0] not in kinds:
            unexpected = f"{self.what} {rank} sent {message[0]!r}, not {' or '.join(kinds)}"
            raise self.fail({rank: message}) or self.error_type(unexpected)
        return message

    def check(self) -> None:
        """Raise the error if a process has died (cheap: reads exit codes only), or stopped."""
        if self.error is None and any(_ended(p) for p in self.procs):
            self.fail()
        if self.error is not None:
            raise self.error
        if not self._stop.alive:
            raise self.error_type(f"the {self.what}s have been shut down")

    def fail(self, read: dict[int, tuple] | None = None) -> RuntimeError | None:
        """After something went wrong: the processes' own errors (None if all fine); all stopped.
        `read`: reports already taken off a pipe (its error, perhaps)."""
        with self._failing:
            return self._fail(read)

    def _fail(self, read: dict[int, tuple] | None) -> RuntimeError | None:
        if self.error is None:
            reasons = []
            for rank, proc, conn in zip(self.ranks, self.procs, self.conns):
                proc.join(timeout=0.5)  # one that raised exits right after reporting it
                kind, text = (read or {}).get(rank) or _last_report(
                    conn, 0.5 if proc.exitcode is None else 0)
                if kind == "error":
                    reasons.append(f"{self.what} {rank} raised:\n{text}")
                elif _ended(proc):
                    code = proc.exitcode
                    reasons.append(f"{self.what} {rank} (pid {proc.pid}) exited" + (
                        "" if code is None else f" with code {code}{_signal_name(code)}"
                        f"{_unguarded_script_hint(code)}"))
            if reasons:
                self.error = self.error_type(f"a {self.what} failed; the LLM has stopped: "
                                             + "\n".join(reasons))
        self.shutdown(polite=False)
        return self.error

    def shutdown(self, polite: bool = True) -> None:
        """Stop every process (asked first, if `polite` and none failed; killed if it stays)."""
        if not polite or self.error is not None:
            self._stop.detach()
            stop(self.procs, self.conns)
        self._stop()


def _ended(proc) -> bool:
    """Whether a child has ended: its exit code, or (when something else reaped it, so that no exit
    code can be read) its sentinel."""
    return proc.exitcode is not None or bool(wait([proc.sentinel], 0))


def _unguarded_script_hint(exitcode: int) -> str:
    """A child that died at start with code 1 while the main script has no `__main__` guard: the
    spawned process re-ran the script, whose top level started minivllm again, and Python refused
    (its long "bootstrapping phase" message, on the child's stderr). Say the fix in one line."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if exitcode != 1 or script is None or not Path(script).is_file():
        return ""
    if "__main__" in Path(script).read_text(errors="replace"):
        return ""
    return (f"\n{script} has no `if __name__ == \"__main__\":` guard: the processes minivllm "
            "starts re-run the script, so put the code that builds the LLM under that guard")


def torchrun_rank(config: EngineConfig) -> int | None:
    """This process's rank when `torchrun` started one process per rank (RANK, WORLD_SIZE set,
    WORLD_SIZE == tensor_parallel_size); None when this process is to spawn its workers itself."""
    if envs.RANK is None or envs.WORLD_SIZE != config.tensor_parallel_size:
        return None
    return envs.RANK


def torchrun_store(timeout_s: float) -> dist.Store:
    """The rendezvous torchrun set up (env://: MASTER_ADDR, MASTER_PORT), by its agent or rank 0."""
    return dist.TCPStore(envs.MASTER_ADDR, envs.MASTER_PORT, envs.WORLD_SIZE,
                         is_master=not envs.TORCHELASTIC_USE_AGENT_STORE and envs.RANK == 0,
                         timeout=timedelta(seconds=timeout_s))


def run_torchrun_worker(config: EngineConfig, timeout_s: float = TIMEOUT_S) -> None:
    """Ranks 1..N-1 under torchrun: `LLM(...)` becomes this loop, and exits when rank 0 is done."""
    local_rank = envs.LOCAL_RANK
    serve_steps(config, envs.RANK, config.tensor_parallel_size, torchrun_store(timeout_s),
                timeout_s, device_index=envs.RANK if local_rank is None else local_rank)
    raise SystemExit(0)


class Workers(ChildProcesses):
    def __init__(self, config: EngineConfig, timeout_s: float = TIMEOUT_S) -> None:
        """Spawn ranks 1..N-1 and join the process groups with them (rank 0 is this process); under
        torchrun the other ranks exist already, and we meet them at its rendezvous."""
        super().__init__(WorkerError, "tensor-parallel rank", polite=False)
        size = config.tensor_parallel_size
        external = torchrun_rank(config) is not None
        self.store = (torchrun_store(timeout_s) if external else
                      dist.TCPStore(HOST, 0, size, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False))
        self.spawn(1 if external else size, worker_main, "minivllm-tp-rank",
                   lambda rank, conn: (config, rank, size, HOST, self.store.port, conn, timeout_s))
        self.expect("joined")
        index = (envs.LOCAL_RANK or 0) if external else 0
        device = (torch.device("cuda", index) if config.device.startswith("cuda")
                  else torch.device(config.device))
        self.tp: TensorParallel = connect(0, size, self.store, device, timeout_s)
        self._stop.detach()  # the same stop, now able to ask the workers to leave politely
        self._stop = weakref.finalize(self, stop, self.procs, self.conns,
                                      functools.partial(_leave, self.tp, self.procs))

    def expect(self, kind: str) -> list:
        """Wait until every worker reports `kind` (loading may take long); death or error raises."""
        return [self.receive(rank, kind)[1] for rank in self.ranks]

    def broadcast(self, obj: object) -> None:
        """Broadcast `obj` (a SchedulerOutput) to every worker; raises if one died since."""
        self.check()
        self.tp.broadcast_object(obj)


def _leave(tp: TensorParallel, procs: list) -> None:
    """Broadcast the None step that ends every worker's loop (when none has died)."""
    if all(p.exitcode is None for p in procs):
        tp.broadcast_object(None)


def _say_none(conns: list[Connection]) -> None:
    """Ask every child to leave: a None message (one already gone is killed after)."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(None)


def receive(conn, timeout_s: float) -> tuple[str, object]:
    """A child's next report, or ("died", None) if it exited without one."""
    try:
        return conn.recv() if conn.poll(timeout_s) else ("died", None)
    except (EOFError, OSError):
        return "died", None


def _last_report(conn: Connection, timeout_s: float) -> tuple[str, object]:
    """The error report a failing process sent last, skipping any report before it."""
    message = receive(conn, timeout_s)
    while message[0] not in ("error", "died"):
        message = receive(conn, 0)
    return message


def _signal_name(exitcode: int) -> str:
    try:
        return f" (killed by {signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    except ValueError:
        return ""


def stop(procs: list, conns: list, ask: Callable[[], None] | None = None) -> None:
    """Ask the processes to leave (`ask`, when given), then kill any still there, close the pipes
    and forget both."""
    with contextlib.suppress(Exception):  # one that went away meanwhile is killed below
        if ask is not None:
            ask()
    for proc in procs:
        proc.join(timeout=5 if ask else 0.1)
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
