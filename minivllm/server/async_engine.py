"""AsyncEngine: one asyncio task owns the LLMEngine; HTTP handlers only send it messages.

LLMEngine is not thread-safe, so only the owner touches it, and requests reach it already tokenized
(preprocess.py). Each turn the owner applies the adds and aborts queued since the last step, then
runs one `step()` on the engine's own thread (engine_thread.py): the event loop keeps serving HTTP
meanwhile, and requests that arrive during a step join the batch of the next one (continuous
batching across clients).

One HTTP call may carry 100,000 prompts; queued at once, they would stand ahead of every later
client. So each call gets a share of the batch (`max_num_seqs / calls`, all of it when alone) and
its other requests wait here until its sequences in the engine drop below that share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from minivllm.engine.input_processor import EngineRequest
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from minivllm.server.engine_thread import EngineThread

log = logging.getLogger("minivllm.server")

StepListener = Callable[[list[RequestOutput], dict], None]
Turn = tuple[list[RequestOutput], dict, bool]  # a step's outputs, the engine's stats, work left
StepFn = Callable[[list[str], list[EngineRequest]], Turn]


def step_once(engine: LLMEngine, aborts: list[str], requests: list[EngineRequest]) -> Turn:
    """One turn of the owner, on the engine's thread: the aborts, the new requests, one step."""
    engine.abort_request(aborts)
    for request in requests:
        engine.enqueue(request)
    outputs = engine.step() if engine.has_unfinished_requests() else []
    return outputs, engine.stats(), engine.has_unfinished_requests()


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is unknown, so it takes no more requests."""


class RequestStream:
    """One HTTP call's engine requests as an async iterator of the outputs updated since the last
    read; outputs are cumulative, so a slow reader gets the newest one per request, no backlog."""

    def __init__(self, request_ids: Sequence[str], requests: Sequence[EngineRequest] = ()) -> None:
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self._latest: dict[str, RequestOutput] = {}
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self.aborted = False  # the server aborted it (shutdown), not the client
        # admission (the owner's): requests[:admitted] are in the engine, in_engine seqs unfinished
        self.requests = list(requests)
        self.admitted = 0
        self.in_engine = 0
        self.seqs: dict[str, int] = {}  # admitted request id -> its sequences (n)
        self.accepted: asyncio.Future | None = None  # done once its first slice is in the engine

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def _put(self, out: RequestOutput) -> None:
        self._latest[out.request_id] = out
        self._ready.set()

    def _abort(self) -> None:
        self.aborted = True
        self.unfinished.clear()
        self._ready.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        outs, self._latest = list(self._latest.values()), {}
        for out in outs:
            if out.finished:
                self.unfinished.discard(out.request_id)
        return outs


@dataclass
class _Add:
    stream: RequestStream


@dataclass
class _Abort:
    request_ids: list[str]


Slice = tuple[RequestStream, list[EngineRequest]]


class AsyncEngine:
    """Run an LLMEngine behind an asyncio API: `await generate(...)` returns a RequestStream."""

    def __init__(self, engine: LLMEngine, step: StepFn | None = None,
                 thread: EngineThread | None = None) -> None:
        """`step`: how a turn reaches the engine (default: `step_once` here; a data-parallel
        engine in another process passes its own, data_parallel.py). `thread`: the thread that
        built the engine, which then runs its steps (`start` makes one when the engine was built
        elsewhere); this AsyncEngine owns it from here on."""
        self.engine = engine
        self._thread = thread
        self._step = step or functools.partial(step_once, engine)
        self.batch = engine.config.max_num_seqs  # sequences a step may run: calls' shares divide it
        self.stats: dict = engine.stats()  # the owner's snapshot after each step, safe to read
        self.error: BaseException | None = None
        self._ops: list[_Add | _Abort] = []
        self._streams: dict[str, RequestStream] = {}
        # accepted calls with unfinished requests, oldest first
        self._calls: dict[RequestStream, None] = {}
        self._listeners: list[StepListener] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = self._thread or EngineThread()
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="minivllm-engine-loop")

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort what runs, let the owner free its blocks (within `timeout`), then stop it; anyone
        still waiting hears so instead of hanging."""
        if self._task is not None:
            self.abort_all()
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def load(self) -> int:
        """Requests this engine holds, running or queued here (data_parallel.py balances on it)."""
        return (sum(len(s.unfinished) for s in self._calls)
                + sum(len(op.stream.request_ids) for op in self._ops if isinstance(op, _Add)))

    def check_health(self) -> None:
        """Raise if the engine cannot serve (a dead tensor-parallel worker, even while idle)."""
        self.engine.check_health()

    def add_listener(self, listener: StepListener) -> None:
        """Call `listener(outputs, stats)` on the event loop after every step (metrics, logs)."""
        self._listeners.append(listener)

    # ---- the API handlers use --------------------------------------------------------------------
    async def generate(self, requests: Sequence[EngineRequest]) -> RequestStream:
        """Queue checked requests, all or none (ValueError names why); returns once the first slice
        is in the engine."""
        if self.error is not None or self._task is None or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        ids = [r.request_id for r in requests]
        queued = {rid for op in self._ops if isinstance(op, _Add) for rid in op.stream.request_ids}
        taken = [rid for rid in ids if rid in self._streams or rid in queued]
        if taken or len(set(ids)) < len(ids):
            raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
        stream = RequestStream(ids, requests)
        stream.accepted = asyncio.get_running_loop().create_future()
        self._ops.append(_Add(stream))
        self._wake.set()
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the caller left before its requests went in: take them out
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort a stream's unfinished requests (freed before the next step)."""
        self._forget([stream])
        stream.unfinished.clear()

    def abort_all(self) -> int:
        """Abort all in flight (shutdown); each stream ends with `aborted` set. Returns how many."""
        streams = set(self._calls)
        streams.update(op.stream for op in self._ops if isinstance(op, _Add)
                       and not op.stream.accepted.done())
        count = sum(len(s.unfinished) for s in streams)
        self._forget(streams)
        for stream in streams:
            stream._abort()
        return count

    def _forget(self, streams: Collection[RequestStream]) -> None:
        """Take streams off the books, and their engine requests out before the next step."""
        ids = [rid for s in streams for rid in s.request_ids[: s.admitted] if rid in s.unfinished]
        for stream in streams:
            self._calls.pop(stream, None)
            for rid in stream.request_ids:
                self._streams.pop(rid, None)
        if ids:
            self._ops.append(_Abort(ids))
        if self._wake is not None:
            self._wake.set()

    # ---- the owner -------------------------------------------------------------------------------
    async def _run(self) -> None:
        has_work = False
        while True:
            ops, self._ops = self._ops, []
            self._accept(ops)
            slices = self._slices()
            aborts = [rid for op in ops if isinstance(op, _Abort) for rid in op.request_ids]
            if not aborts and not slices and not has_work:
                if self._stopping:
                    return
                if not self._ops:
                    self._wake.clear()
                    await self._wake.wait()
                continue
            try:
                new = [r for _, requests in slices for r in requests]
                outputs, stats, has_work = await self._thread.run(self._step, aborts, new)
            except Exception as e:  # whatever broke the step, every waiting client must hear of it
                self._die(e)
                return
            self._deliver(slices, outputs, stats)
            if has_work and not outputs and not aborts and not slices:
                await asyncio.sleep(0.001)  # nothing could be scheduled this step: do not spin

    def _accept(self, ops: list[_Add | _Abort]) -> None:
        """New calls join the admission line (unless shutdown or their caller got there first)."""
        for op in ops:
            if not isinstance(op, _Add) or op.stream.accepted.done():  # done: its caller aborted
                continue
            if op.stream.aborted:
                op.stream.accepted.set_exception(EngineDeadError("the server is shutting down"))
                continue
            self._calls[op.stream] = None
            for rid in op.stream.request_ids:
                self._streams[rid] = op.stream

    def _slices(self) -> list[Slice]:
        """Each call's next requests, up to its share of the batch (one at least, if none is in)."""
        share = self.batch if len(self._calls) <= 1 else max(1, self.batch // len(self._calls))
        out = []
        for stream in self._calls:
            todo = stream.requests
            if stream.admitted == len(todo):
                continue
            take, room = stream.admitted, share - stream.in_engine
            while take < len(todo) and (take == stream.admitted and stream.in_engine == 0 or
                                        todo[take].params.n <= room):
                room -= todo[take].params.n
                take += 1
            if take > stream.admitted:
                out.append((stream, todo[stream.admitted : take]))
                for r in todo[stream.admitted : take]:
                    stream.seqs[r.request_id] = r.params.n
                    stream.in_engine += r.params.n
                stream.admitted = take
        return out

    def _deliver(self, slices: list[Slice], outputs: list[RequestOutput], stats: dict) -> None:
        for stream, _ in slices:
            if not stream.accepted.done():
                stream.accepted.set_result(None)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
                if out.finished:
                    del self._streams[out.request_id]
                    stream.in_engine -= stream.seqs.pop(out.request_id, 0)
                    if stream.admitted == len(stream.requests) and stream.in_engine == 0:
                        self._calls.pop(stream, None)
        self.stats = stats
        for listener in self._listeners:
            try:
                listener(outputs, stats)
            except Exception:  # a broken metric must not stop generation
                log.exception("step listener failed")

    def _die(self, exc: Exception) -> None:
        log.error("engine step failed; no more requests will be served", exc_info=exc)
        self.error = exc
        self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))

    def _fail_all(self, dead: EngineDeadError) -> None:
        streams = set(self._calls) | set(self._streams.values())
        streams.update(op.stream for op in self._ops if isinstance(op, _Add))
        for stream in streams:
            if stream.accepted is not None and not stream.accepted.done():
                stream.accepted.set_exception(dead)
            stream._fail(dead)
        self._ops = []
        self._streams.clear()
        self._calls.clear()
