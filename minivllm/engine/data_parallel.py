"""Data-parallel engines: the requests of one `generate` spread over N whole engines.

Tensor parallelism splits one model over processes that step together. Data parallelism runs N
whole engines, each with its own scheduler and KV cache, and gives each a share of the requests:
nothing passes between them while they run, so a plain pipe per engine carries everything (a batch
in, its outputs back) and no process group is needed. The weights are the only thing they share,
and the kernel shares them: every engine maps one weight-cache file (model/weight_cache.py).

Engine 0 is this process's own LLMEngine, so a single-engine run pays for no extra process; engines
1..N-1 run `engine_main` in processes started and watched by executor/workers.py's ChildProcesses.
Requests are dealt round-robin, so each engine gets as many (give or take one) whatever their
lengths: choosing the least loaded would need an estimate of each request's cost, which pays off
for a stream (a server) more than for one batch. Outputs come back in input order.

A dead engine is an error, not a hang: a watcher thread waits on the other processes while engine
0 runs its share, and if one ends it aborts engine 0's requests so `generate` raises at once. One
`generate` at a time crosses the pipes (a lock). A call interrupted (Ctrl-C) leaves the others
finishing their shares: the next call waits for those outputs and drops them.
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
from minivllm.executor.worker import report_failure
from minivllm.executor.workers import ChildProcesses
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

# engine 0's own share: (request ids, prompts, params, priorities) -> its outputs, in order
RunLocal = Callable[[list[str], list, list, list[int]], list[RequestOutput]]


class DataParallelError(RuntimeError):
    """A data-parallel engine process died or failed: the LLM cannot continue."""


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
        self.processes = ChildProcesses(DataParallelError, "data-parallel engine")
        # engines 1..N-1 load their model while the caller loads engine 0's
        self.processes.spawn(self.size, engine_main, "minivllm-dp-engine",
                             lambda rank, conn: (config, rank, conn))
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

        def pick(rank: int) -> list[list]:  # engine `rank`'s ids, prompts, params, priorities
            return [[col[i] for i in shares[rank]] for col in (ids, prompts, params, priority)]

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
            def watch() -> None:  # another engine died while engine 0 runs: stop its share now
                if self.processes.wait_for_death(cancel_watch):
                    abort_local(local_ids)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                local = run_local(*pick(0)) if local_ids else []
            except ValueError as e:  # the others' outputs must still be collected, then this
                local = e
            finally:
                cancel.send(None)
                watcher.join()
                cancel.close()
                cancel_watch.close()
            results = {0: local} | {rank: self._collect(rank) for rank in busy}
        out: list[RequestOutput | None] = [None] * len(ids)
        for rank, outputs in results.items():
            if isinstance(outputs, ValueError):  # a request an engine refused (engine 0's first)
                raise outputs
            for i, output in zip(shares[rank], outputs):
                out[i] = output
        return out

    def _collect(self, rank: int) -> list[RequestOutput] | ValueError:
        """Engine `rank`'s outputs, or the ValueError with which it refused its share."""
        self.processes.check()  # one that died while engine 0 worked: its error, not a bare EOF
        outputs = self.processes.receive(rank, "outputs", "raised")[1]
        self._owed.discard(rank)
        return outputs

    def shutdown(self) -> None:
        self.processes.shutdown()

