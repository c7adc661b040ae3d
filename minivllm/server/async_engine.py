"""AsyncEngine: one asyncio task owns the LLMEngine; HTTP handlers only send it messages.

Why a single owner: LLMEngine is not thread-safe (add, abort and step all touch the scheduler and the block
pool), so only the owner task touches it; requests reach it already tokenized and checked (preprocess.py), so
a huge prompt never holds up a step. Why a worker thread: a step is CPU-bound torch work (up to seconds on
a CPU), and on the event loop it would stall every connection. So the owner runs the adds and aborts queued
since the last step, then one `step()`, in a worker thread (`asyncio.to_thread`) and awaits it: the event loop
keeps serving HTTP meanwhile, nothing else touches the engine, and requests that arrive during a step are added
right before the next one, so they join the running batch (continuous batching across clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minivllm.engine.input_processor import EngineRequest
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput

log = logging.getLogger("minivllm.server")

StepListener = Callable[[list[RequestOutput], dict], None]


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is unknown, so it takes no more requests."""


class RequestStream:
    """The outputs of one HTTP call's engine requests (one per prompt), as an async iterator.

    Each item is the list of outputs updated since the last read. Outputs are cumulative, so a slow reader
    only ever sees the newest one per request: nothing piles up while it is busy writing to its socket.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self._latest: dict[str, RequestOutput] = {}
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self.aborted = False  # the server aborted it (shutdown), not the client

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
    requests: list[EngineRequest]
    stream: RequestStream
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _WorkResult:
    errors: list[BaseException | None] = field(default_factory=list)  # one per op, None when it went in
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    has_work: bool = False


class AsyncEngine:
    """Run an LLMEngine behind an asyncio API: `await generate(...)` returns a RequestStream."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats: dict = engine.stats()  # a snapshot taken by the owner after each step, safe to read
        self.error: BaseException | None = None
        self._ops: list[_Add | _Abort] = []
        self._streams: dict[str, RequestStream] = {}
        self._listeners: list[StepListener] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the owner task on the running event loop (the server's)."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="minivllm-engine-loop")

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs, let the owner free its blocks (bounded by `timeout`), then stop it;
        anyone still waiting hears so instead of hanging (uvicorn drains requests first)."""
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
        self._fail_all(EngineDeadError("the server is shutting down"), [])

    def add_listener(self, listener: StepListener) -> None:
        """Call `listener(outputs, stats)` on the event loop after every step (metrics, request logs)."""
        self._listeners.append(listener)

    # ---- the API handlers use ----------------------------------------------------------------------
    async def generate(self, requests: Sequence[EngineRequest]) -> RequestStream:
        """Queue checked requests (preprocess.py makes them); all go in or none (ValueError names why)."""
        if self.error is not None or self._task is None or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        ids = [r.request_id for r in requests]
        queued = {r.request_id for op in self._ops if isinstance(op, _Add) for r in op.requests}
        taken = [rid for rid in ids if rid in self._streams or rid in queued]
        if taken or len(set(ids)) < len(ids):
            raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
        stream = RequestStream(ids)
        accepted = asyncio.get_running_loop().create_future()
        self._ops.append(_Add(list(requests), stream, accepted))
        self._wake.set()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller went away before its requests went in: take them out again
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort a stream's unfinished requests; their blocks are freed before the next step."""
        ids = [rid for rid in stream.request_ids if rid in stream.unfinished]
        if not ids:
            return
        for rid in ids:
            self._streams.pop(rid, None)
        stream.unfinished.clear()
        self._ops.append(_Abort(ids))
        if self._wake is not None:
            self._wake.set()

    def abort_all(self) -> int:
        """Abort every request in flight (shutdown): each stream ends with `aborted` set; returns how many."""
        streams = set(self._streams.values())
        for op in self._ops:
            if isinstance(op, _Add) and not op.accepted.done():
                streams.add(op.stream)
        ids = [rid for stream in streams for rid in stream.request_ids if rid in stream.unfinished]
        for stream in streams:
            stream._abort()
        for rid in ids:
            self._streams.pop(rid, None)
        if ids:
            self._ops.append(_Abort(ids))
            if self._wake is not None:
                self._wake.set()
        return len(ids)

    # ---- the owner ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        has_work = False
        while True:
            if not self._ops and not has_work:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            ops, self._ops = self._ops, []
            try:
                result = await asyncio.to_thread(self._work, ops)
            except Exception as e:  # whatever broke the step, every waiting client must hear of it
                self._die(e, ops)
                return
            self._deliver(ops, result)
            has_work = result.has_work
            if has_work and not result.outputs and not ops:
                await asyncio.sleep(0.001)  # nothing could be scheduled this step: do not spin

    def _work(self, ops: list[_Add | _Abort]) -> _WorkResult:
        """In the worker thread: apply the queued adds and aborts in order, then take one step."""
        eng, result = self.engine, _WorkResult()
        for op in ops:
            if isinstance(op, _Abort):
                for rid in op.request_ids:
                    eng.abort_request(rid)
                result.errors.append(None)
                continue
            if op.stream.aborted:  # aborted (shutdown) before it went in
                result.errors.append(EngineDeadError("the server is shutting down"))
                continue
            for request in op.requests:
                eng.enqueue(request)
            result.errors.append(None)
        if eng.has_unfinished_requests():
            result.outputs = eng.step()
        result.stats = eng.stats()
        result.has_work = eng.has_unfinished_requests()
        return result

    def _deliver(self, ops: list[_Add | _Abort], result: _WorkResult) -> None:
        for op, err in zip(ops, result.errors):
            if not isinstance(op, _Add):
                continue
            if err is not None:
                op.stream.unfinished.clear()
                if not op.accepted.done():
                    op.accepted.set_exception(err)
                continue
            if op.accepted.done():  # cancelled: the caller queued an abort for these right after
                continue
            for rid in op.stream.request_ids:
                self._streams[rid] = op.stream
            op.accepted.set_result(None)
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
                if out.finished:
                    del self._streams[out.request_id]
        self.stats = result.stats
        for listener in self._listeners:
            try:
                listener(result.outputs, result.stats)
            except Exception:  # a broken metric must not stop generation
                log.exception("step listener failed")

    def _die(self, exc: Exception, ops: list[_Add | _Abort]) -> None:
        log.error("engine step failed; no more requests will be served", exc_info=exc)
        self.error = exc
        self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"), ops)

    def _fail_all(self, dead: EngineDeadError, ops: list[_Add | _Abort]) -> None:
        for op in ops + self._ops:
            if isinstance(op, _Add) and not op.accepted.done():
                op.accepted.set_exception(dead)
        self._ops = []
        for stream in set(self._streams.values()):
            stream._fail(dead)
        self._streams.clear()
