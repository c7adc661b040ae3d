"""Data-parallel engines: the requests of one `generate` spread over N whole engines.

    engine 0 (this process)      engines 1..N-1 (executor/data_parallel.py spawns them)
    LLMEngine + StepDriver       `engine_main`: an LLMEngine, then one batch per message

Each engine has its own scheduler and KV cache and runs its share to completion on its own; all map
one copy of the weights (model/weight_cache.py: the first to start writes the file, the others wait
for it, then all map it). Requests are dealt round-robin: prompt i goes to engine i mod N, so each
engine gets as many (give or take one), whatever their lengths. Choosing the least loaded engine
would need an estimate of each request's cost, and pays off for a stream of requests (a server)
more than for one batch handed over at once. Outputs come back in input order.

A dead engine is an error, not a hang: while engine 0 runs its own share a watcher thread waits on
the other processes, and if one ends it aborts engine 0's requests, so `generate` returns at once
and raises a DataParallelError with that engine's own traceback (or exit code). One `generate` at a
time crosses the pipes (a lock): calls from several threads take turns rather than share a batch.
A call interrupted (Ctrl-C) leaves the other engines finishing their shares: the next call waits
for those outputs and drops them before it deals its own.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from minivllm.config import EngineConfig
from minivllm.engine.input_processor import PromptType
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.step_driver import StepDriver
from minivllm.executor.data_parallel import EngineProcesses
from minivllm.executor.worker import report_failure
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

# engine 0's own share: (request ids, prompts, params, priorities) -> its outputs, in order
RunLocal = Callable[[list[str], list, list, list[int]], list[RequestOutput]]


def engine_main(config: EngineConfig, rank: int, conn: Connection) -> None:
    """What engines 1..N-1 run: build the engine, report ("ready", blocks), then answer each batch
    with ("outputs", ...) until None. A request's own error (a bad prompt) comes back as ("raised",
    exception) and the engine goes on; any other is ("error", traceback), and the process exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is engine 0's to handle: it stops us
    try:
        engine = LLMEngine(config, rank)
        driver = StepDriver(engine)
        conn.send(("ready", engine.runner.num_blocks))
        while (batch := conn.recv()) is not None:
            try:
                conn.send(("outputs", driver.run(*batch)))
            except ValueError as e:  # refused before any step ran: the engine is as it was
                conn.send(("raised", e))
    except BaseException:  # noqa: BLE001 - whatever it was, engine 0 must hear it
        report_failure(conn)


def deal(count: int, engines: int) -> list[list[int]]:
    """Round-robin: the indices of the requests each engine runs."""
    return [list(range(rank, count, engines)) for rank in range(engines)]


class DataParallelEngines:
    """Engines 1..N-1 and how one `generate` call uses them beside engine 0 (the caller's)."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.data_parallel_size
        self.processes = EngineProcesses(config, engine_main)
        self._lock = threading.Lock()
        self._owed: set[int] = set()  # engines whose outputs an interrupted call left unread

    def wait_ready(self) -> list[int]:
        """Each engine's KV blocks, once all have loaded (a failed start raises its error)."""
        return [self.processes.receive(rank, "ready")[1] for rank in self.processes.ranks]

    def generate(self, ids: list[str], prompts: Sequence[PromptType],
                 params: Sequence[SamplingParams], priority: Sequence[int], run_local: RunLocal,
                 abort_local: Callable[[list[str]], None]) -> list[RequestOutput]:
        """Deal the requests out, run engine 0's share with `run_local` while the others run
        theirs, and return every output in input order."""
        shares = deal(len(ids), self.size)

        def pick(rank: int) -> tuple[list, list, list, list]:
            take = shares[rank]
            return ([ids[i] for i in take], [prompts[i] for i in take],
                    [params[i] for i in take], [priority[i] for i in take])

        with self._lock:
            self.processes.check()  # a failed or stopped LLM raises, whatever the shares
            for rank in sorted(self._owed):  # (Ctrl-C): wait for that work, and drop it
                self._collect(rank)
            busy = [rank for rank in self.processes.ranks if shares[rank]]
            for rank in busy:
                self.processes.send(rank, pick(rank))
                self._owed.add(rank)
            local_ids = pick(0)[0]
            cancel_watch, cancel = Pipe(duplex=False)
            watcher = threading.Thread(target=self._watch, args=(cancel_watch, local_ids,
                                                                 abort_local), daemon=True)
            watcher.start()
            local, refused = [], None
            try:
                local = run_local(*pick(0)) if local_ids else []
            except ValueError as e:  # the others' outputs must still be collected, then this
                refused = e
            finally:
                cancel.send(None)
                watcher.join()
                cancel.close()
                cancel_watch.close()
            results = {0: local}
            for rank in busy:
                results[rank] = self._collect(rank)
        if refused is not None:
            raise refused
        for rank in busy:  # a request another engine refused
            if isinstance(results[rank], ValueError):
                raise results[rank]
        out: list[RequestOutput | None] = [None] * len(ids)
        for rank, share in enumerate(shares):
            for i, output in zip(share, results.get(rank, [])):
                out[i] = output
        return out

    def _collect(self, rank: int) -> list[RequestOutput] | ValueError:
        """Engine `rank`'s outputs, or the ValueError with which it refused its share."""
        self.processes.check()  # one that died while engine 0 worked: its error, not a bare EOF
        outputs = self.processes.receive(rank, "outputs", "raised")[1]
        self._owed.discard(rank)
        return outputs

    def _watch(self, cancel: Connection, local_ids: list[str],
               abort_local: Callable[[list[str]], None]) -> None:
        """If another engine dies while engine 0 runs its share, stop engine 0's share at once."""
        if self.processes.wait_for_death(cancel):
            abort_local(local_ids)

    def shutdown(self) -> None:
        self.processes.shutdown()

