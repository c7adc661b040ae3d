"""The FastAPI app: OpenAI-compatible routes, health, metrics, and every error in OpenAI's error shape.

`build_app(engine)` wraps an existing LLMEngine (tests build small ones); `serve(...)` loads a model and runs
uvicorn, as `minivllm serve` does.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server.async_engine import AsyncEngine
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from minivllm.server.serving import OpenAIServing

log = logging.getLogger("minivllm.server")


def build_app(engine: LLMEngine, model_name: str | None = None) -> FastAPI:
    """An app serving `engine` under `model_name` (default: the checkpoint directory's name)."""
    name = model_name or engine.config.served_model_name
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics()
    async_engine.add_listener(metrics.observe)
    serving = OpenAIServing(async_engine, name)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.stop()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "minivllm",
                                            "max_model_len": engine.config.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(async_engine.stats), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(str(exc.detail), status=exc.status_code, type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return JSONResponse(APIError(f"internal error: {exc!r}", status=500, type="server_error").body(),
                            status_code=500)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one message naming each bad field (union types repeat a field once per branch)."""
    if errors and errors[0]["type"] == "json_invalid":
        why = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
        return APIError(f"the request body is not valid JSON: {why}", code="invalid_json")
    by_field: dict[str, list[str]] = {}
    for err in errors:
        loc = err["loc"]
        field = str(loc[1]) if len(loc) > 1 and loc[0] == "body" else "body"
        msgs = by_field.setdefault(field, [])
        detail = err["msg"] if err["type"] == "missing" else f"{err['msg']} (got {err.get('input')!r:.60})"
        if detail not in msgs:
            msgs.append(detail)
    parts = [f"{'request body' if f == 'body' else f}: {' or '.join(m[:3])}" for f, m in by_field.items()]
    first = next(iter(by_field), None)
    return APIError("; ".join(parts), param=None if first == "body" else first)


def serve(model: str | None = None, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          log_level: str = "info", **engine_kwargs) -> None:
    """Load the model, then serve it until interrupted."""

    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    engine = LLMEngine(EngineConfig(model=model, trace_steps=0, **engine_kwargs))
    log.info("serving %s on http://%s:%d (%d KV blocks of %d tokens, max_model_len %d)", engine.config.model,
             host, port, engine.kv.pool.num_blocks, engine.config.block_size, engine.config.max_model_len)
    config = uvicorn.Config(build_app(engine, model_name), host=host, port=port, log_level=log_level)
    QuietExitServer(config).run()


class QuietExitServer(uvicorn.Server):
    """uvicorn re-raises Ctrl-C or SIGTERM after its graceful shutdown, which prints a KeyboardInterrupt traceback
    from inside asyncio.run (or dies of SIGTERM); a command line should just exit 0 after a clean shutdown. So here
    the signals only ask the server to exit (a second one forces it), as uvicorn's own handler does."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
