"""HTTP connections a slow client cannot hold open, and protocol errors in OpenAI's shape.

uvicorn times out only idle keep-alive connections: a client that sends half its headers, or part of
its body, holds a slot for as long as it likes. Here each request has `read_timeout` seconds from
its first byte to its last, then a 408 and a closed connection (which the handlers see as a
hang-up). uvicorn's 400 for malformed HTTP is plain text; here it is OpenAI's error object.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.server.limits import error_body


def raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A closing HTTP/1.1 response, without h11 (which won't answer a request it has not read)."""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a per-request read deadline and JSON protocol errors."""

    read_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Armed while a request is read; disarmed once read, or idle (keep-alive's timeout)."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        waiting_head = state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0])
        if not (state is h11.SEND_BODY or waiting_head):
            self._stop_timer()
        elif self._read_timer is None:  # counted from the first byte: dribbling does not extend it
            self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        answering = (self.cycle is not None and self.conn.their_state is h11.SEND_BODY
                     and self.cycle.response_started)
        if not answering:
            body = error_body(f"the request was not received within {self.read_timeout:g} s",
                              "invalid_request_error", "request_timeout")
            self.transport.write(raw_response(408, "Request Timeout", body))
        self.logger.warning("closing a connection whose request took over %g s to arrive",
                            self.read_timeout)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = error_body(f"malformed HTTP request: {msg}", "invalid_request_error", "invalid_http")
        self.transport.write(raw_response(400, "Bad Request", body))
        self.transport.close()


def http_protocol(read_timeout: float) -> type[GuardedH11Protocol]:
    if not read_timeout > 0:
        raise ValueError(f"the request read timeout must be > 0 seconds, got {read_timeout!r}")
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": float(read_timeout)})
