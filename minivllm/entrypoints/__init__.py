"""vLLM's entry points under vLLM's module paths: `python -m
minivllm.entrypoints.openai.api_server`."""
