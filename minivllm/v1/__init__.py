"""vLLM's `vllm.v1.*` import paths as thin re-exports (the README's "vLLM import paths" table)."""
