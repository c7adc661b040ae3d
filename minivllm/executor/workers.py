"""Rank 0's handle on its worker processes: start them, hear from them, notice deaths, stop them.

Rendezvous is a TCPStore that rank 0 opens on a port the OS picks (port 0), so two engines on one
machine, or tests in parallel, never collide; nothing else is named. Each worker also has a pipe to
rank 0 for its start-up reports and its last error: collectives say only that a peer went away, the
pipe says why. Stopping is idempotent and also runs when the handle is garbage-collected or the
interpreter exits (weakref.finalize), so no worker outlives the engine.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from multiprocessing.connection import wait

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


class Workers:
    def __init__(self, config: EngineConfig, timeout_s: float = TIMEOUT_S) -> None:
        """Spawn ranks 1..N-1 and join the process groups with them (rank 0 is this process); under
        torchrun the other ranks exist already, and we meet them at its rendezvous."""
        size = config.tensor_parallel_size
        self.error: WorkerError | None = None
        self.procs, self.conns = [], []
        self._stop = weakref.finalize(self, stop, self.procs, self.conns, [])
        external = torchrun_rank(config) is not None
        self.store = (torchrun_store(timeout_s) if external else
                      dist.TCPStore(HOST, 0, size, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False))
        ctx = mp.get_context("spawn")
        for rank in range(1, 1 if external else size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"minivllm-tp-rank{rank}", daemon=True,
                               args=(config, rank, size, HOST, self.store.port, child, timeout_s))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.expect("joined")
        index = (envs.LOCAL_RANK or 0) if external else 0
        device = (torch.device("cuda", index) if config.device.startswith("cuda")
                  else torch.device(config.device))
        self.tp: TensorParallel = connect(0, size, self.store, device, timeout_s)
        self._stop.detach()  # the same stop, now able to ask the workers to leave politely
        self._stop = weakref.finalize(self, stop, self.procs, self.conns, [self.tp])

    def expect(self, kind: str) -> list:
        """Wait until every worker reports `kind` (loading may take long); death or error raises."""
        payloads = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            wait([conn, proc.sentinel])
            message = receive(conn, 0)
            if message[0] != kind:
                raise self.fail() or WorkerError(f"rank {rank} sent {message[0]!r}, not {kind!r}")
            payloads.append(message[1])
        return payloads

    def check(self) -> None:
        """Raise the WorkerError if a worker has died (cheap: reads exit codes only), or stopped."""
        if self.error is None and any(p.exitcode is not None for p in self.procs):
            self.fail()
        if self.error is not None:
            raise self.error
        if not self._stop.alive:
            raise WorkerError("the tensor-parallel workers have been shut down")

    def send(self, obj: object) -> None:
        """Broadcast `obj` (a SchedulerOutput) to every worker; raises if one died since."""
        self.check()
        self.tp.broadcast_object(obj)

    def fail(self) -> WorkerError | None:
        """After something went wrong: the workers' own errors (None if all fine), all stopped."""
        if self.error is None:
            reasons = []
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
                proc.join(timeout=0.5)  # a worker that raised exits right after reporting it
                kind, text = receive(conn, 0.5 if proc.exitcode is None else 0)
                if kind == "error":
                    reasons.append(f"rank {rank} raised:\n{text}")
                    continue
                if proc.exitcode is not None:
                    reasons.append(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
            if reasons:
                self.error = WorkerError("tensor-parallel worker failed; the engine has stopped: "
                                         + "\n".join(reasons))
        self.shutdown(polite=False)
        return self.error

    def shutdown(self, polite: bool = True) -> None:
        """Stop every worker (asked first, if `polite` and none failed; killed if it stays)."""
        if not polite or self.error is not None:
            self._stop.detach()
            stop(self.procs, self.conns, [])
        self._stop()

    @property
    def alive(self) -> bool:
        return (self.error is None and bool(self._stop.alive)
                and all(p.exitcode is None for p in self.procs))


def receive(conn, timeout_s: float) -> tuple[str, object]:
    """A worker's next report, or ("died", None) if it exited without one."""
    try:
        return conn.recv() if conn.poll(timeout_s) else ("died", None)
    except (EOFError, OSError):
        return "died", None


def stop(procs: list, conns: list, groups: list[TensorParallel]) -> None:
    """Ask the workers to leave (a None step, when a group is given), then kill any still there."""
    if groups and all(p.exitcode is None for p in procs):
        try:
            groups[0].broadcast_object(None)
        except Exception:  # noqa: BLE001 - a worker went away meanwhile: it is killed below
            pass
    reap(procs, conns, 5 if groups else 0.1)


def reap(procs: list, conns: list, wait_s: float) -> None:
    """Give each process `wait_s` to exit, kill any still there, close the pipes and forget both
    (tensor-parallel workers and data-parallel engines alike)."""
    for proc in procs:
        proc.join(timeout=wait_s)
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
