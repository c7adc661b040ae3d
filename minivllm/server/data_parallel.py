"""`minivllm serve -dp N`: N whole engines behind one server, each call sent to the least loaded.

Engine 0 runs in the server's process under its own AsyncEngine, exactly as a single engine does.
Engines 1..N-1 are child processes, started and watched by executor/workers.py's ChildProcesses
as for the offline LLM, all mapping one copy of the weights (model/weight_cache.py). A child runs
`remote_engine_main`: it receives a turn (the aborts and new requests since its last step), runs
it with the `step_once` engine 0 runs, and sends back the outputs and its stats. In the server each
child has its own AsyncEngine whose worker thread waits on the child's pipe instead of stepping, so
the N owners run side by side, each batching its own requests continuously, while the event loop
stays free: streaming, `n`, aborts on disconnect and shutdown work per engine as for one.

Which engine: the one holding the fewest unfinished requests (ties: the one chosen longest ago). A
server sees a stream of requests whose output lengths nobody knows in advance; counting what each
engine still holds follows what actually happens (an engine busy with long generations gets fewer
new calls), where round-robin, right for one batch dealt at once (the offline LLM), would keep
feeding it. A call's prompts stay on one engine, so each stream has one owner.

A dead engine is an error, never a hang: its owner's turn raises the child's own traceback (or its
exit code), which fails that engine's requests with a 503 naming it; the processes' handle then
stops the other children, later calls are refused with the same error, and /health answers 503
(the process stays up to say why; restarting it is the operator's, or the orchestrator's on
/health). An idle engine has no turn to raise, so a watcher thread blocks on the children's
sentinels and fails the handle the moment one ends: the server knows whatever its load, not only
when a request happens to check. "Ends" is the kernel's word, not /proc's: a multi-threaded child
killed by a signal shows "Z" before its last thread is gone, and only then can anyone read its exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import weakref
from collections.abc import Sequence
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from minivllm.config import EngineConfig
from minivllm.engine.data_parallel import DataParallelError
from minivllm.engine.input_processor import EngineRequest
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor.worker import report_failure
from minivllm.executor.workers import ChildProcesses
from minivllm.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestStream,
    StepListener,
    Turn,
    step_once,
)
from minivllm.server.engine_thread import EngineThread

log = logging.getLogger("minivllm.server")


def remote_engine_main(config: EngineConfig, rank: int, conn: Connection) -> None:
    """What engines 1..N-1 run: build the engine, report ("ready", stats), then answer each turn
    (aborts, requests) with ("stepped", turn's result) until None; any error is reported and ends
    the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it stops us
    try:
        engine = LLMEngine(config, rank)
        conn.send(("ready", engine.stats()))
        while (turn := conn.recv()) is not None:
            conn.send(("stepped", step_once(engine, *turn)))
    except BaseException:  # noqa: BLE001 - whatever it was, the server must hear it
        report_failure(conn)


class RemoteEngine:
    """Engine `rank` as its AsyncEngine sees it: its config, its latest stats, and `step`."""

    def __init__(self, processes: ChildProcesses, rank: int, config: EngineConfig,
                 stats: dict) -> None:
        self.processes, self.rank, self.config, self._stats = processes, rank, config, stats

    def stats(self) -> dict:
        return self._stats

    def check_health(self) -> None:
        self.processes.check()

    def step(self, aborts: list[str], requests: list[EngineRequest]) -> Turn:
        """One turn in the child (from the owner's worker thread); raises the child's error."""
        self.processes.send(self.rank, (aborts, requests))
        outputs, self._stats, busy = self.processes.receive(self.rank, "stepped")[1]
        return outputs, self._stats, busy


class DataParallelAsyncEngine:
    """AsyncEngine's API over N engines: `generate` picks one; the stream's owner does the rest."""

    def __init__(self, engine: LLMEngine, processes: ChildProcesses,
                 remote_stats: Sequence[dict], thread: EngineThread | None = None) -> None:
        """`thread`: the EngineThread that built engine 0, to step it."""
        self.engine = engine  # engine 0: the preprocessor reads its config and tokenizer
        self.processes = processes
        remotes = [RemoteEngine(processes, rank, engine.config, stats)
                   for rank, stats in zip(processes.ranks, remote_stats)]
        self.engines = [AsyncEngine(engine, thread=thread),
                        *(AsyncEngine(r, r.step) for r in remotes)]
        self._owner: weakref.WeakKeyDictionary[RequestStream, AsyncEngine] = (
            weakref.WeakKeyDictionary())
        self._last_pick = [0] * len(self.engines)
        self._picks = 0
        self._listeners: list[StepListener] = []
        for e in self.engines:
            e.add_listener(self._stepped)
        self._watcher: threading.Thread | None = None
        self._cancel_watch: Connection | None = None

    @classmethod
    def launch(cls, config: EngineConfig,
               thread: EngineThread | None = None) -> DataParallelAsyncEngine:
        """Start engines 1..N-1, load engine 0 here meanwhile (on `thread`, which will step it),
        and wait until all are ready."""
        thread = thread or EngineThread()
        processes = ChildProcesses(DataParallelError, "data-parallel engine")
        processes.spawn(config.data_parallel_size, remote_engine_main, "minivllm-dp-engine",
                        lambda rank, conn: (config, rank, conn))
        try:
            engine = thread.build(LLMEngine, config, 0)
            stats = [processes.receive(rank, "ready")[1] for rank in processes.ranks]
        except BaseException:
            processes.shutdown(polite=False)
            thread.close()
            raise
        return cls(engine, processes, stats, thread)

    # ---- what the server reads -------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self.engines if e.error is not None), self.processes.error)

    @property
    def stats(self) -> dict:
        """The engines' stats added up (counters and gauges alike), as one engine's would read."""
        total: dict = {}
        for e in self.engines:
            for key, value in e.stats.items():
                if isinstance(value, list):  # per position: add where both have one
                    old = total.get(key, [])
                    longer = old if len(old) > len(value) else value
                    total[key] = [a + b for a, b in zip(old, value)] + longer[len(
                        min(old, value, key=len)):]
                elif isinstance(value, (int, float)):
                    total[key] = total.get(key, 0) + value
        total["prefix_cache_hit_rate"] = (total.get("prefix_cache_hits", 0)
                                          / max(total.get("prefix_cache_queries", 0), 1))
        return total

    def check_health(self) -> None:
        self.processes.check()  # a child that died while idle, too
        for e in self.engines:
            e.check_health()

    def add_listener(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def _stepped(self, outputs: list, _: dict) -> None:
        stats = self.stats
        for listener in self._listeners:
            listener(outputs, stats)

    # ---- lifecycle and requests ------------------------------------------------------------------
    def start(self) -> None:
        for e in self.engines:
            e.start()
        watch, self._cancel_watch = Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, args=(watch,), daemon=True,
                                         name="minivllm-dp-watcher")
        self._watcher.start()

    def _watch(self, cancel: Connection) -> None:
        """Until cancelled: when a child ends, fail the handle (its error, the others stopped)."""
        try:
            if self.processes.wait_for_death(cancel):
                if (error := self.processes.fail()) is not None:
                    log.error("%s; no more requests will be served", error)
        finally:
            cancel.close()

    def _stop_watching(self) -> None:
        if self._watcher is not None:
            self._cancel_watch.send(None)
            self._watcher.join()
            self._cancel_watch.close()
            self._watcher = None

    async def stop(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self._stop_watching)  # stopping the children is no death
        await asyncio.gather(*(e.stop(timeout) for e in self.engines))
        self.processes.shutdown()

    async def generate(self, requests: Sequence[EngineRequest]) -> RequestStream:
        error = self.error
        if error is None:
            try:
                self.processes.check()
            except DataParallelError as e:
                error = e
        if error is not None:
            raise EngineDeadError(f"the engine is not running: {error!r}")
        i = min(range(len(self.engines)), key=lambda i: (self.engines[i].load, self._last_pick[i]))
        self._picks += 1
        self._last_pick[i] = self._picks
        stream = await self.engines[i].generate(requests)
        self._owner[stream] = self.engines[i]
        return stream

    def abort(self, stream: RequestStream) -> None:
        owner = self._owner.get(stream)
        if owner is not None:
            owner.abort(stream)

    def abort_all(self) -> int:
        return sum(e.abort_all() for e in self.engines)
