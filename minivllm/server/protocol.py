"""The OpenAI wire format: request bodies (checked strictly, so "5" is not an integer) and errors.

Types are strict because a client that sends the wrong type has a bug it should hear about, as the
OpenAI API tells it; value ranges are left to SamplingParams, the one place that defines them.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.responses import Response

from minivllm.core.sequence import FinishReason
from minivllm.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputsParams
from minivllm.server.limits import MAX_N, error_body

log = logging.getLogger("minivllm.server")

# OpenAI fields this engine cannot honour: rejected when set, rather than silently ignored.
UNSUPPORTED = ("suffix", "tools", "tool_choice", "functions", "function_call")
# Passed to SamplingParams as they are, when given: OpenAI's and vLLM's extra sampling fields.
PASSED_THROUGH = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "n", "stop", "stop_token_ids", "seed",
                  "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                  "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
                  "bad_words", "prompt_logprobs")


def integral(value: Any) -> Any:
    """5.0 is an integer in JSON Schema (and to OpenAI): accepted as 5; "5" and 5.5 still fail."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]


class APIError(Exception):
    """An error the client caused (or can act on), rendered as OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.type = status, type

    def response(self, headers: dict | None = None) -> Response:
        return Response(self.body(), self.status, headers, media_type="application/json")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def clamp(value: float, bound: float) -> float:
    """value within [-bound, bound]; NaN stays NaN, for SamplingParams to refuse by name."""
    return value if value != value else min(bound, max(-bound, value))


def engine_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """Turn the engine's ValueError (bad prompt, bad sampling value, too long) into a 400 naming the
    field; `prompt_param`: what the prompt is called in this request ("messages" for chat)."""
    msg = str(e)
    m = re.match(r"SamplingParams\.(\w+)", msg)
    if m:
        param = m.group(1)
    elif "max_tokens" in msg or "KV blocks" in msg:
        param = "max_tokens"
    elif "priority" in msg:
        param = "priority"
    elif ("chat template" in msg or "chat_template" in msg or prompt_param == "messages"
          and "surrogate" in msg):
        param = "messages"
    elif msg.startswith("structured outputs"):
        param = "structured_outputs"
    else:
        param = prompt_param
    return APIError(msg, param=param)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: ignored, as OpenAI's


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk, not only the last


class JSONSchemaFormat(Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(Lenient):
    """The fields both endpoints share. None means "the default", as clients sending null expect."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    n: Int | None = Field(None, le=MAX_N)  # the server's cap; ServerLimits.max_n may lower it
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # torch seeds are 64-bit, as vLLM's
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    min_tokens: Int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: Int | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = Field(None, ge=-1)
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer spelling: {"json": ...}
    priority: Int = 0  # vLLM's extra field: with --scheduling-policy priority, lower runs first

    def check_supported(self) -> None:
        for name in UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, 0, 0.0, [], {}):
                raise APIError(f"{name} is not supported by minivllm", param=name,
                               code="unsupported_parameter")
        # vLLM's rule for fields it does not know: serve the request, say what was ignored
        if ignored := sorted(set(self.model_extra or {}) - set(UNSUPPORTED)):
            log.warning("the request's fields %s are not known to minivllm and were ignored",
                        ignored)
        if self.best_of not in (None, 1, self.n or 1):  # 1: no candidates beyond the n returned
            raise APIError("best_of is not supported by minivllm (only best_of == n)",
                           param="best_of", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kwargs = {k: getattr(self, k) for k in PASSED_THROUGH if getattr(self, k) is not None}
        max_tokens = self.requested_max_tokens()
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        bias = self.logit_bias or {}
        if not all(k.isascii() and k.isdigit() and (k == "0" or k[0] != "0") for k in bias):
            raise APIError(f"logit_bias keys must be token ids, got {list(bias)[:3]}",
                           param="logit_bias")
        # clamped to OpenAI's [-100, 100] as vLLM does: beyond it, nothing changes but overflow
        logit_bias = (None if self.logit_bias is None
                      else {int(k): clamp(v, MAX_LOGIT_BIAS) for k, v in bias.items()})
        try:
            return SamplingParams(max_tokens=max_tokens, logit_bias=logit_bias,
                                  logprobs=self.sample_logprobs(),
                                  structured_outputs=self.structured(), **kwargs)
        except ValueError as e:
            raise engine_error(e) from e

    def sample_logprobs(self) -> int | None:
        """Top alternatives per generated token the client asked for (None: no logprobs)."""
        return None

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint: response_format, a guided_* field or structured_outputs."""
        given: dict[str, dict] = {}  # field -> StructuredOutputsParams' arguments
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError("response_format json_schema needs a json_schema.schema",
                               param="response_format")
            given["response_format"] = {"json": fmt.json_schema.schema_}
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                given[field] = {key: getattr(self, field)}
        if self.structured_outputs:
            given["structured_outputs"] = self.structured_outputs
        if len(given) > 1:
            raise APIError(f"give one output constraint, not {sorted(given)}",
                           param=sorted(given)[1])
        if not given:
            return None
        (field, spec), = given.items()
        try:
            return StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:
            raise APIError(f"{field}: {e}", param=field) from e

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and (self.stream_options.include_usage
                                                    or self.continuous_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=-1)  # top alternatives per token (max_logprobs caps)
    echo: bool | None = False  # the prompt before the completion (with its logprobs, if asked)

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # echo shows the prompt's logprobs too
        return params

    def prompts(self) -> list[str | dict]:
        """The engine prompts: one per string or token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=-1)  # -1: the whole vocabulary, if --max-logprobs -1

    def sample_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def requested_max_tokens(self) -> int | None:
        """OpenAI renamed max_tokens to max_completion_tokens for chat; either is accepted."""
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)


def conversation(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    return [m.as_template_input() for m in messages]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted request only ever reaches a client that left."""
    return reason if reason in (None, FinishReason.STOP,
                                FinishReason.LENGTH) else FinishReason.STOP.value


# vLLM's /tokenize and /detokenize request bodies: clients use them to count tokens before they send
class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Int]


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
