"""vLLM's `vllm.v1.engine.async_llm`: AsyncLLM lives in minivllm/engine/async_llm.py."""

from minivllm.engine.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
