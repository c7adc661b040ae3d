"""The OpenAI wire format: request bodies (checked strictly, so "5" is not an integer) and errors.

Types are strict because a client that sends the wrong type has a bug it should hear about, as the OpenAI API
tells it; value ranges are left to SamplingParams, the one place that defines them.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from minivllm.sampling_params import SamplingParams

# OpenAI fields this engine cannot honour: rejected when set, rather than silently ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "tool_choice", "functions",
               "function_call", "response_format", "presence_penalty", "frequency_penalty")


class APIError(Exception):
    """An error the client caused (or can act on), rendered as OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(e: ValueError) -> APIError:
    """Turn the engine's ValueError (bad prompt, bad sampling value, too long) into a 400 naming the field."""
    msg = str(e)
    m = re.match(r"SamplingParams\.(\w+)", msg)
    if m:
        param = m.group(1)
    elif "max_tokens" in msg or "KV blocks" in msg:
        param = "max_tokens"
    elif "priority" in msg:
        param = "priority"
    elif "chat template" in msg or "chat_template" in msg:
        param = "messages"
    else:
        param = "prompt"
    return APIError(msg, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. None means "the default", as clients that send nulls expect."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = None
    priority: int = 0  # vLLM's extra field: with --scheduling-policy priority, lower runs first

    def check_supported(self) -> None:
        for name in UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, 0, 0.0, [], {}):
                raise APIError(f"{name} is not supported by minivllm", param=name, code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of is not supported by minivllm (only best_of == n)", param="best_of",
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n", "stop", "stop_token_ids",
                 "seed", "ignore_eos")
        kwargs = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        max_tokens = self.requested_max_tokens()
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, **kwargs)
        except ValueError as e:
            raise engine_error(e) from e

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

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


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        return [m.as_template_input() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        """OpenAI renamed max_tokens to max_completion_tokens for chat; either is accepted."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows "stop" and "length"; an aborted request only ever reaches a client that left."""
    return reason if reason in (None, "stop", "length") else "stop"
