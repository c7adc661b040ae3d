"""Request logs: one timed `logging` record per request event (received, first_token, finished,
aborted) on "minivllm.server.requests", its fields in `extra`: a line of text by default, one JSON
object under `--log-format json`. The id is the client's X-Request-Id when it sends one, so a call
can be followed from a proxy's logs into ours.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

from minivllm.core.sequence import FinishReason
from minivllm.outputs import RequestOutput

log = logging.getLogger("minivllm.server.requests")
_VALID_ID = re.compile(r"[A-Za-z0-9._:/=+-]{1,128}")  # a client's X-Request-Id we take as it is


@dataclass
class _Tracked:
    request_id: str
    received: float  # time.monotonic(), as the engine's own metrics
    first_token: bool = False


class RequestLog:
    """Fed by the engine loop's outputs (a step listener) and the handlers' `received()` calls."""

    def __init__(self) -> None:
        self._by_engine_id: dict[str, _Tracked] = {}

    def received(self, request_id: str, engine_ids: list[str], arrival: float, **fields) -> None:
        for eid in engine_ids:
            self._by_engine_id[eid] = _Tracked(request_id, arrival)
        _emit("received", request_id, **fields)

    def rejected(self, request_id: str, engine_ids: list[str], status: int, message: str) -> None:
        for eid in engine_ids:
            self._by_engine_id.pop(eid, None)
        _emit("rejected", request_id, status=status, error=message[:200])

    def observe(self, outputs: list[RequestOutput], stats: dict) -> None:
        for out in outputs:
            t = self._by_engine_id.get(out.request_id)
            if t is None:
                continue
            m = out.metrics
            if not t.first_token and m and m.first_token_time is not None:
                t.first_token = True
                _emit("first_token", t.request_id, engine_request_id=out.request_id,
                      queue_s=_secs(m.first_scheduled_time, t.received),
                      ttft_s=_secs(m.first_token_time, t.received))
            if out.finished:
                del self._by_engine_id[out.request_id]
                reasons = [c.finish_reason or FinishReason.ABORT.value for c in out.outputs]
                end = m.finished_time if m and m.finished_time else time.monotonic()
                aborted = FinishReason.ABORT in reasons
                _emit("aborted" if aborted else "finished", t.request_id,
                      engine_request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids),
                      output_tokens=sum(len(c.token_ids) for c in out.outputs),
                      cached_tokens=out.num_cached_tokens, preemptions=out.num_preemptions,
                      ttft_s=_secs(m.first_token_time if m else None, t.received),
                      total_s=_secs(end, t.received),
                      finish_reason=reasons[0] if len(reasons) == 1 else reasons)


def _emit(event: str, request_id: str, **fields) -> None:
    if log.isEnabledFor(logging.INFO):
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        log.info("%s %s %s", event, request_id, text,
                 extra={"event": event, "request_id": request_id, **fields})


def _secs(t: float | None, since: float) -> float | None:
    return None if t is None else round(t - since, 6)


def configure_logging(level: str, fmt: str) -> None:
    """Root logging for `minivllm serve`: human-readable lines, or one JSON object per record."""
    fields = "%(asctime)s %(levelname)s %(name)s %(message)s"
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(fields, rename_fields={
            "asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(fields))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))


class RequestIdMiddleware:
    """`request.state.request_id`: the client's X-Request-Id or a fresh one, echoed in the reply."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = header if _VALID_ID.fullmatch(header) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
