"""The OpenAI-compatible server's entry points at vLLM's paths (the server is minivllm/server/)."""
