"""vLLM's `vllm.v1.engine.async_llm`: AsyncLLM lives in minivllm/server/async_llm.py."""

from minivllm.server.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
