"""Graceful shutdown with a bound: uvicorn's own waits for the longest stream, however long.

The first SIGTERM or Ctrl-C stops accepting connections and gives the requests in flight
`shutdown_timeout` seconds; the rest are then aborted (their streams end with finish_reason "abort")
and the process exits 0. A second signal aborts everything at once. Unlike uvicorn, the signal is
not re-raised afterwards: it only asks the server to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn

from minivllm.server.async_engine import AsyncEngine

log = logging.getLogger("minivllm.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: stop waiting for anyone
            self.force_exit = True
            self._abort_all("second signal")
        else:
            log.info("shutting down: in-flight requests get %.1f s, then they are aborted",
                     self.shutdown_timeout)
            self.should_exit = True

    def _abort_all(self, why: str) -> None:
        def abort() -> None:
            n = self.engine.abort_all()
            if n:
                log.warning("aborted %d request(s) still running at shutdown (%s)", n, why)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(abort)

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort_all,
                                                      "shutdown timeout")
        try:
            await super().shutdown(sockets)
            # uvicorn skips the lifespan's shutdown then; ours is bounded and frees the blocks
            if self.force_exit:
                await self.lifespan.shutdown()
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
