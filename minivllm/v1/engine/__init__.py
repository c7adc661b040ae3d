"""vLLM's `vllm.v1.engine` path (re-exports only)."""
