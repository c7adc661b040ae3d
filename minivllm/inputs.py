"""vLLM's `vllm.inputs` prompt types: typed dicts that `LLM.generate` and `AsyncLLM.generate` take.

They are plain dicts at run time (`TokensPrompt(prompt_token_ids=[...])` is `{"prompt_token_ids":
[...]}`), which is what the engine's input processor reads.
"""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, when known, reported back in RequestOutput.prompt


__all__ = ["TextPrompt", "TokensPrompt"]
