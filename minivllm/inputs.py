"""vLLM's `vllm.inputs` prompt types: plain dicts at run time, which the input processor reads."""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, when known, reported back in RequestOutput.prompt


__all__ = ["TextPrompt", "TokensPrompt"]
