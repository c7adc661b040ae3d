"""The schema at /openapi.json says what the server really sends: 400 (not FastAPI's 422) for a bad body, and
OpenAI's error object for every error status, so generated clients and the fuzz test can rely on it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that can answer with these error statuses."""
    why = {400: "Invalid request (a bad field, a prompt too long, a limit exceeded)",
           401: "Missing or wrong API key (only with --api-key)", 404: "No such model or route",
           413: "Request body above --max-request-bytes", 503: "The engine is not running"}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}


def body_errors() -> dict[int | str, dict[str, Any]]:
    return errors(400, 401, 413, 503)


def json_object(*required: str, streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """A 200 whose JSON body is an object with these keys (and server-sent events when it streams)."""
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object", "required": list(required)}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {200: {"description": "OK", "content": content}}


LOGPROB_FIELDS = {"CompletionRequest": ("logprobs", "prompt_logprobs"),
                  "ChatCompletionRequest": ("top_logprobs", "prompt_logprobs")}


def bound_logprobs(schema: dict[str, Any], max_logprobs: int) -> None:
    """The logprob fields' range as this engine's max_logprobs allows it ([0, cap], or -1 and up when -1)."""
    bounds = {"minimum": -1} if max_logprobs == -1 else {"minimum": 0, "maximum": max_logprobs}
    components = schema.get("components", {}).get("schemas", {})
    for model, names in LOGPROB_FIELDS.items():
        for name in names:
            prop = components.get(model, {}).get("properties", {}).get(name)
            for branch in (prop or {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch.pop("maximum", None)
                    branch.update(bounds)


def install(app: FastAPI, max_logprobs: int = 20) -> None:
    """Replace app.openapi with one that drops FastAPI's 422 entries and their schemas, and bounds the logprob
    fields by the engine's max_logprobs."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            bound_logprobs(schema, max_logprobs)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
