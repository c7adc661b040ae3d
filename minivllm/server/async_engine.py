"""AsyncEngine: one asyncio task owns the LLMEngine; HTTP handlers only send it messages.

Why a single owner: LLMEngine is not thread-safe (add, abort and step all touch the scheduler and the block
pool), so only the owner task touches it. Why a worker thread: a step is CPU-bound torch work (up to seconds on
a CPU), and on the event loop it would stall every connection. So the owner runs the adds and aborts queued
since the last step, then one `step()`, in a worker thread (`asyncio.to_thread`) and awaits it: the event loop
keeps serving HTTP meanwhile, nothing else touches the engine, and requests that arrive during a step are added
right before the next one, so they join the running batch (continuous batching across clients).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

log = logging.getLogger("minivllm.server")

# A prompt, or a function the owner calls to build one (chat templates run there, not in the handler, since
# the tokenizer is shared with the engine and not safe to use from two threads at once).
PromptSource = PromptType | Callable[[], PromptType]
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

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def _put(self, out: RequestOutput) -> None:
        self._latest[out.request_id] = out
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
    prompts: list[tuple[str, PromptSource]]
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    accepted: asyncio.Future
    priority: int = 0


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

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the owner task on the running event loop (the server's)."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="minivllm-engine-loop")

    async def stop(self) -> None:
        """Stop stepping; anyone still waiting hears so instead of hanging (uvicorn drains requests first)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all(EngineDeadError("the server is shutting down"), [])

    def add_listener(self, listener: StepListener) -> None:
        """Call `listener(outputs, stats)` on the event loop after every step (metrics, request logs)."""
        self._listeners.append(listener)

    # ---- the API handlers use ----------------------------------------------------------------------
    async def generate(self, prompts: Sequence[tuple[str, PromptSource]], params: SamplingParams,
                       arrival_time: float | None = None, priority: int = 0) -> RequestStream:
        """Queue one engine request per (request id, prompt); all go in or none (ValueError names why)."""
        if self.error is not None or self._task is None:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        stream = RequestStream([rid for rid, _ in prompts])
        accepted = asyncio.get_running_loop().create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._ops.append(_Add(list(prompts), params, arrival, stream, accepted, priority))
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

    # ---- the owner ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        has_work = False
        while True:
            if not self._ops and not has_work:
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
            try:
                batch = [eng.process_request(rid, p() if callable(p) else p, op.params, op.arrival_time, op.priority)
                         for rid, p in op.prompts]  # validate every prompt before queueing any
            except Exception as e:  # handed to this request's handler; the loop goes on
                result.errors.append(e)
                continue
            for request in batch:
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
            for rid, _ in op.prompts:
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
