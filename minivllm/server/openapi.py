"""The schema at /openapi.json says what the server really sends: 400 (not FastAPI's 422) for a bad
body, and OpenAI's error object for every error status, so generated clients and fuzzers rely on it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from minivllm.sampling_params import REPETITION_PENALTY_RANGE


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


BODY_ERRORS = (400, 401, 404, 413, 503)  # what a route that reads a request body can answer


def responses(*required: str, errors: tuple[int, ...] = (),
              streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: a 200 object with these keys (or SSE), errors in OpenAI's shape."""
    why = {400: "Invalid request (a bad field, a prompt too long, a limit exceeded)",
           401: "Missing or wrong API key (only with --api-key)", 404: "No such model or route",
           413: "Request body above --max-request-bytes", 503: "The engine is not running"}
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object",
                                                               "required": list(required)}}}
    if streams:  # one server-sent event: its data is a JSON chunk, or [DONE] at the end
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {name: {"type": "string"} for name
                                                                  in ("data", "event", "id")}}}
    return {200: {"description": "OK", "content": content},
            **{s: {"model": ErrorResponse, "description": why[s]} for s in errors}}


def has(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for: the object has the field `name`, and its value matches `schema`."""
    return {"required": [name], "properties": {name: schema}}


LOGPROB_FIELDS = {"CompletionRequest": ("logprobs", "prompt_logprobs"),
                  "ChatCompletionRequest": ("top_logprobs", "prompt_logprobs")}
UNBOUNDED = {("TokenizeCompletionRequest", "prompt")}  # "" tokenizes fine (to nothing, or a BOS)
BODIES = ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest",
          "TokenizeChatRequest", "DetokenizeRequest")


def below_pattern(n: int) -> str:
    """A regex for the integers 0 .. n-1 in decimal, no sign or leading zero (logit_bias's keys)."""
    top = str(n - 1)
    alternatives = ["[0-9]"] if len(top) > 1 else [f"[0-{top}]"]
    alternatives += [f"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(top))]
    if len(top) > 1:
        for i, digit in enumerate(top):
            low = "1" if i == 0 else "0"
            if digit > low:
                alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
        alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def structured_outputs_schema() -> dict[str, Any]:
    """vLLM's structured_outputs: exactly one of its fields given (json_object only when true)."""
    kinds = {"json": {"type": ["string", "object"]}, "regex": {"type": "string", "format": "regex"},
             "choice": {"type": "array", "minItems": 1,
                        "items": {"type": "string", "minLength": 1}},
             "grammar": {"type": "string"}, "json_object": {"type": "boolean"}}
    given = {**kinds, "json_object": {"const": True}}
    return {"additionalProperties": False,
            "properties": {name: {"anyOf": [kind, {"type": "null"}]}
                           for name, kind in kinds.items()},
            "oneOf": [has(name, kind) for name, kind in given.items()]}


def value_ranges(vocab_size: int, max_n: int, priority: bool,
                 max_model_len: int) -> dict[str, dict[str, Any]]:
    """Field -> JSON Schema keywords for what SamplingParams and the engine accept, so a client (or
    a fuzzer) can tell a valid request from the schema; checking stays in SamplingParams. Keywords
    constrain only values of their type, so one set serves a union (`stop`: string or list)."""
    token = {"minimum": 0, "maximum": vocab_size - 1}
    words = {"minLength": 1, "pattern": r"\S"}
    length = {"minimum": 1, "maximum": max_model_len - 1}
    return {
        "max_tokens": length, "max_completion_tokens": length, "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
        "min_p": {"minimum": 0, "maximum": 1},
        "repetition_penalty": {"minimum": REPETITION_PENALTY_RANGE[0],
                               "maximum": REPETITION_PENALTY_RANGE[1]},
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "n": {"minimum": 1, "maximum": max_n}, "best_of": {"minimum": 1, "maximum": 1},
        "min_tokens": {"minimum": 0}, "truncate_prompt_tokens": {"minimum": 1},
        "stop": {"minLength": 1, "items": {"minLength": 1}}, "stop_token_ids": {"items": token},
        "allowed_token_ids": {"minItems": 1, "items": token}, "bad_words": {"items": words},
        "guided_choice": {"minItems": 1, "items": {"minLength": 1}}, "messages": {"minItems": 1},
        "prompt": {"minLength": 1, "minItems": 1, "items": {**token, "minLength": 1, "minItems": 1,
                                                            "items": token}},
        "tokens": {"items": token}, "guided_regex": {"format": "regex"},
        "structured_outputs": structured_outputs_schema(),
        "logit_bias": {"propertyNames": {"pattern": below_pattern(vocab_size)}},
        **({} if priority else {"priority": {"minimum": 0, "maximum": 0}}),
    }


CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")


def across_fields(chat: bool) -> list[dict[str, Any]]:
    """stream_options only with stream; one output constraint; chat: top_logprobs needs logprobs."""
    rules = [{"if": has("stream_options", {"type": "object"}),
              "then": has("stream", {"const": True})}]
    is_set = {name: has(name, {"not": {"type": "null"}}) for name in CONSTRAINTS}
    is_set["response_format"] = has("response_format", {"type": "object",
                                                        **has("type", {"not": {"const": "text"}})})
    names = list(is_set)
    rules.append({"not": {"anyOf": [{"allOf": [is_set[a], is_set[b]]} for i, a in enumerate(names)
                                    for b in names[i + 1 :]]}})
    if chat:
        rules.append({"if": has("top_logprobs", {"type": "integer", "not": {"const": 0}}),
                      "then": has("logprobs", {"const": True})})
    return rules


def merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """extra's keywords into a property schema, into its own `items` where it has one."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def bound_fields(schema: dict[str, Any], max_logprobs: int,
                 ranges: dict[str, dict[str, Any]]) -> None:
    """The value ranges into the bodies' properties; logprobs: [0, max_logprobs] (or >= -1)."""
    components = schema.get("components", {}).get("schemas", {})
    for model in BODIES:
        for name, prop in components.get(model, {}).get("properties", {}).items():
            if (model, name) not in UNBOUNDED:
                merge(prop, ranges.get(name, {}))
    if "ResponseFormat" in components:  # type json_schema needs json_schema.schema
        components["ResponseFormat"]["if"] = {"properties": {"type": {"const": "json_schema"}}}
        components["ResponseFormat"]["then"] = has("json_schema", {
            "type": "object", **has("schema", {"type": "object"})})
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        if model in components:
            components[model]["allOf"] = across_fields(model == "ChatCompletionRequest")
    bounds = {"minimum": -1} if max_logprobs == -1 else {"minimum": 0, "maximum": max_logprobs}
    for model, names in LOGPROB_FIELDS.items():
        for name in names:
            prop = components.get(model, {}).get("properties", {}).get(name)
            for branch in (prop or {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch.pop("maximum", None)
                    branch.update(bounds)


def install(app: FastAPI, max_logprobs: int = 20,
            ranges: dict[str, dict[str, Any]] | None = None) -> None:
    """app.openapi without FastAPI's 422s, with the value ranges the server accepts."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            bound_fields(schema, max_logprobs, ranges or {})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
