"""Request limits an operator sets, and the ASGI middleware that enforces the body-size one.

Why a body cap before anything parses it: a 50 MB JSON body costs memory and seconds of parsing
before any field can be checked, so the size is checked first, from Content-Length when the client
sends one and while reading otherwise, and the request is answered 413 without reading the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_N = 128  # sequences per prompt (OpenAI's own cap on n is 128)


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 4 * 2**20  # a 128k-token context as JSON token ids fits well within
    max_n: int = MAX_N
    max_tokens_times_n: int = 2**17  # output tokens one call may ask for: max_tokens x n x prompts
    read_timeout: float = 30.0  # seconds from a request's first byte to its last (connection.py)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI's error object, ASCII-escaped: no echoed input (a lone surrogate, say) breaks it."""
    return json.dumps({"error": {"message": message, "type": type, "param": param,
                                 "code": code}}).encode()


async def send_error(send: Send, status: int, body: bytes,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    """413 for a body larger than `max_bytes`; otherwise the body it read is replayed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_big = error_body(f"the request body is larger than this server's limit of "
                             f"{self.max_bytes} bytes",
                             "invalid_request_error", "request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, too_big, [(b"connection", b"close")])
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:  # a chunked upload past the cap: stop reading, close
                await send_error(send, 413, too_big, [(b"connection", b"close")])
                return
            more = message.get("more_body", False)
        unread = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay() -> Message:
            # the body once, then what follows it: the disconnect the handlers watch for
            return unread.pop() if unread else await receive()

        await self.app(scope, replay, send)
