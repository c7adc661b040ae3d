"""vLLM's entry points at vLLM's paths: `python -m minivllm.entrypoints.openai.api_server`."""
