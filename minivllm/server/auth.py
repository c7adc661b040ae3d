"""`--api-key`: every route but the probes needs `Authorization: Bearer <key>`, as in vLLM.

The probes (/health, /ping, /version, /metrics) stay open so that load balancers and Prometheus need
no secret; CORS preflights (OPTIONS) stay open because browsers never send credentials with them.
The key is compared with hmac.compare_digest, whose time does not depend on how much of a guess is
right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.server.limits import error_body, send_error

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                              "authentication_error", "invalid_api_key")
            await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


def resolve_api_key(given: str | None, from_env: str | None) -> str | None:
    """--api-key wins, else VLLM_API_KEY (`from_env`) as vLLM reads it; an empty value: no key."""
    return given or from_env or None
