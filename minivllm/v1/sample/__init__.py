"""vLLM's `vllm.v1.sample` path (re-exports only)."""
