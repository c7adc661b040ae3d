"""What a request must pass before any handler reads it: the body-size cap and `--api-key`.

The body's size is checked first (from Content-Length, else while reading): a 50 MB JSON body costs
memory and seconds of parsing before any field can be checked, so it gets a 413 unread. The API key
is vLLM's `Authorization: Bearer <key>`, compared in constant time (hmac.compare_digest); the probes
stay open for load balancers and Prometheus, and CORS preflights because browsers send no
credentials with them.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_N = 128  # sequences per prompt (OpenAI's own cap on n is 128)
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


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
                             f"{self.max_bytes} bytes", "invalid_request_error",
                             "request_too_large")
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

        async def replay() -> Message:  # the body once, then the disconnect the handlers watch for
            return unread.pop() if unread else await receive()

        await self.app(scope, replay, send)


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS
                or hmac.compare_digest(given, self.expected)):
            await self.app(scope, receive, send)
            return
        body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                          "authentication_error", "invalid_api_key")
        await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])


def resolve_api_key(given: str | None, from_env: str | None) -> str | None:
    """--api-key wins, else VLLM_API_KEY (`from_env`) as vLLM reads it; an empty value: no key."""
    return given or from_env or None
