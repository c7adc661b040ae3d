"""The FastAPI app: OpenAI- and vLLM-compatible routes, health, metrics, errors in OpenAI's shape.

`build_app(engine)` wraps an existing LLMEngine; `serve(...)` loads a model and runs uvicorn, as
`minivllm serve` does. Middleware, outermost first: CORS, request ids, the API key, the body-size
cap, so a rejected request costs almost nothing; below them the HTTP protocol (connection.py) gives
each request a read deadline. Every error, down to a malformed request line, is OpenAI's JSON.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

import minivllm
from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import ServerMetrics
from minivllm.server import openapi
from minivllm.server.async_engine import AsyncEngine
from minivllm.server.connection import http_protocol
from minivllm.server.data_parallel import DataParallelAsyncEngine
from minivllm.server.engine_thread import EngineThread
from minivllm.server.limits import APIKeyAuth, BodySizeLimit, ServerLimits, resolve_api_key
from minivllm.server.preprocess import Preprocessor
from minivllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    conversation,
    engine_error,
)
from minivllm.server.request_log import RequestIdMiddleware, RequestLog, configure_logging
from minivllm.server.serving import OpenAIServing
from minivllm.server.shutdown import GracefulServer

log = logging.getLogger("minivllm.server")


class JSONErrorCORS(CORSMiddleware):
    """Starlette's CORS; a refused preflight says why in OpenAI's error shape, not plain text."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items()
                   if k not in ("content-length", "content-type")}
        why = response.body.decode()  # "Disallowed CORS origin, method"
        message = f"CORS preflight refused: {why[len('Disallowed CORS '):]} not allowed"
        return APIError(message, code="cors_refused").response(headers)


def build_app(engine: LLMEngine | DataParallelAsyncEngine, model_name: str | None = None, *,
              limits: ServerLimits | None = None, api_key: str | None = None,
              allowed_origins: list[str] | tuple[str, ...] = (),
              chat_template: str | None = None, thread: EngineThread | None = None) -> FastAPI:
    """An app serving `engine` (or data-parallel engines) under `model_name` (default: the
    engine's served_model_name); `thread`: the EngineThread that built `engine`, to step it."""
    if isinstance(engine, DataParallelAsyncEngine):
        async_engine, engine = engine, engine.engine
    else:
        async_engine = AsyncEngine(engine, thread=thread)
    name = model_name or engine.config.served_model_name
    limits = limits or ServerLimits()
    metrics = ServerMetrics(name)
    request_log = RequestLog()
    async_engine.add_listener(metrics.observe)
    async_engine.add_listener(request_log.observe)
    pre = Preprocessor(engine, chat_template=chat_template)
    serving = OpenAIServing(async_engine, name, pre, limits, request_log)
    created = int(time.time())
    max_model_len = engine.config.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.stop()
        pre.close()
        stats = async_engine.stats
        log.info("engine stopped: %d of %d KV blocks free", stats["num_free_blocks"],
                 stats["num_total_blocks"])

    app = FastAPI(title="minivllm", version=minivllm.__version__, lifespan=lifespan)
    app.state.engine = async_engine
    _add_error_handlers(app)
    openapi.install(app, engine.config.max_logprobs, openapi.value_ranges(
        engine.config.model_config.vocab_size, limits.max_n,
        engine.config.scheduling_policy == "priority", max_model_len))
    # what wraps every call, innermost first: body-size cap, API key, request id, CORS
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(JSONErrorCORS, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"], expose_headers=["X-Request-Id"],
                       allow_credentials=False)

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "minivllm",
                "max_model_len": max_model_len}

    _add_openai_routes(app, serving, model_card)
    _add_token_routes(app, serving, pre, max_model_len)
    _add_ops_routes(app, async_engine, metrics)
    return app


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, model_card) -> None:
    @app.post("/v1/completions",
              responses=openapi.responses("choices", errors=openapi.BODY_ERRORS, streams=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions",
              responses=openapi.responses("choices", errors=openapi.BODY_ERRORS, streams=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models", responses=openapi.responses("object", "data", errors=(401,)))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}",
             responses=openapi.responses("id", "object", errors=(401, 404)))
    async def model(model_id: str = Path(examples=[model_card()["id"]])) -> dict:
        # the example: the served name, so that a fuzzer reaches the 200 too, not only 404s
        serving.check_model(model_id)
        return model_card()


def _add_token_routes(app: FastAPI, serving: OpenAIServing, pre: Preprocessor,
                      max_model_len: int) -> None:
    @app.post("/tokenize", responses=openapi.responses("count", "max_model_len", "tokens",
                                                       errors=openapi.BODY_ERRORS))
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        serving.check_model(body.model)
        try:
            if isinstance(body, TokenizeChatRequest):
                messages = conversation(body.messages)
                chat = await pre.chat_prompt(messages, body.add_generation_prompt)
                tokens = chat["prompt_token_ids"]
                if body.add_special_tokens:
                    tokens = await pre.tokenize(chat["prompt"], True)
            else:
                tokens = await pre.tokenize(body.prompt, body.add_special_tokens)
        except ValueError as e:
            raise engine_error(e) from e
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                "token_strs": None}

    @app.post("/detokenize", responses=openapi.responses("prompt", errors=openapi.BODY_ERRORS))
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        try:
            return {"prompt": await pre.detokenize(body.tokens)}
        except ValueError as e:
            raise APIError(str(e), param="tokens") from e


def _add_ops_routes(app: FastAPI, async_engine: AsyncEngine | DataParallelAsyncEngine,
                    metrics: ServerMetrics) -> None:
    """What operators probe: health (and SageMaker's ping), the version, Prometheus metrics."""
    @app.get("/health", responses={**openapi.responses("status"),
                                   503: {"description": "The engine died"}})
    async def health() -> Response:
        error = async_engine.error
        if error is None:
            try:
                async_engine.check_health()
            except RuntimeError as e:
                error = e
        if error is not None:
            return JSONResponse({"status": "error", "error": repr(error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ping", responses=openapi.responses("status"))
    async def ping() -> Response:
        return await health()

    app.post("/ping", responses=openapi.responses("status"), operation_id="ping_post")(ping)

    @app.get("/version", responses=openapi.responses("version"))
    async def version() -> dict:
        return {"version": minivllm.__version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(async_engine.stats), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message, code = str(exc.detail), None  # FastAPI: "There was an error parsing the body"
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message, code = (f"the request body is not valid UTF-8: {exc.__cause__.reason} "
                             f"at byte {exc.__cause__.start}", "invalid_json")
        elif isinstance(exc.__cause__, RecursionError):
            message, code = "the request body's JSON is nested too deeply to parse", "invalid_json"
        headers = exc.headers
        # Starlette's Allow lists the first route of the path's; say every method it has
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
        return APIError(message, status=exc.status_code, type=kind, code=code).response(headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path, exc_info=exc)
        return APIError(f"internal error: {exc!r}", status=500, type="server_error").response()


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path."""
    return sorted({method for route in request.app.router.routes
                   if getattr(route, "methods", None) and route.path_regex.match(request.url.path)
                   for method in route.methods})


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one message naming each bad field (unions repeat a field per branch)."""
    if errors and errors[0]["type"] == "json_invalid":
        why = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
        return APIError(f"the request body is not valid JSON: {why}", code="invalid_json")
    by_field: dict[str, list[str]] = {}
    for err in errors:
        loc = err["loc"]
        # a union body (/tokenize) puts the branch's name before the field: skip it
        rest = ([p for p in loc[1:] if not (isinstance(p, str) and p.endswith("Request"))]
                if loc[0] == "body" else [])
        field = str(rest[0]) if rest else "body"
        msgs = by_field.setdefault(field, [])
        detail = (err["msg"] if err["type"] == "missing"
                  else f"{err['msg']} (got {err.get('input')!r:.60})")
        if detail not in msgs:
            msgs.append(detail)
    parts = [f"{'request body' if f == 'body' else f}: {' or '.join(m[:3])}" for f,
             m in by_field.items()]
    first = next(iter(by_field), None)
    return APIError("; ".join(parts), param=None if first == "body" else first)


def serve(model: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          model_name: str | None = None, log_level: str = "info", log_format: str = "text",
          api_key: str | None = None, allowed_origins: list[str] | tuple[str, ...] = (),
          shutdown_timeout: float = 30.0, limits: ServerLimits | None = None,
          chat_template: str | None = None, engine_config: EngineConfig | None = None,
          **engine_kwargs) -> None:
    """Load the model (or `engine_config`'s) and serve it until SIGTERM or Ctrl-C (shutdown.py)."""
    limits = limits or ServerLimits()
    configure_logging(log_level, log_format)
    api_key = resolve_api_key(api_key, envs.VLLM_API_KEY)
    config = replace(engine_config or EngineConfig(model=model, **engine_kwargs), trace_steps=0)
    # data_parallel_size > 1: engines 1..N-1 in child processes beside this one's
    # (data_parallel.py); this process's engine is built on the thread that steps it
    # (engine_thread.py)
    thread = EngineThread()
    served = (DataParallelAsyncEngine.launch(config, thread) if config.data_parallel_size > 1
              else thread.build(LLMEngine, config))
    engine = served.engine if isinstance(served, DataParallelAsyncEngine) else served
    log.info("serving %s on http://%s:%d (%d engine(s) of %d KV blocks of %d tokens, "
             "max_model_len %d%s)", engine.config.model, host, port, config.data_parallel_size,
             engine.kv.pool.num_blocks, engine.config.block_size, engine.config.max_model_len,
             ", API key required" if api_key else "")
    app = build_app(served, model_name, limits=limits, api_key=api_key,
                    allowed_origins=allowed_origins, chat_template=chat_template, thread=thread)
    # ~400k objects (the model, tokenizers, libraries) live as long as the process: keep them out of
    # the GC's full collections, which would pause every thread to walk them (as vLLM does too).
    gc.collect()
    gc.freeze()
    log_config = None if log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=log_config,
                            timeout_graceful_shutdown=shutdown_timeout + 10,
                            http=http_protocol(limits.read_timeout))
    try:
        GracefulServer(config, app.state.engine, shutdown_timeout).run()
    finally:
        gc.unfreeze()  # so interpreter shutdown finalizes them as usual
