"""vLLM's /tokenize and /detokenize request bodies: clients use them to count tokens before they
send."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from minivllm.server.protocol import ChatMessage, Int


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[Int]
