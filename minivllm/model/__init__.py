"""The model families (one module each: llama.py, mistral.py, qwen2.py, qwen3.py; registry.py maps a
checkpoint's `architectures` to them) and their Hugging Face loader."""

from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import (
    generation_defaults,
    load_model,
    read_generation_config,
    read_model_config,
)

__all__ = ["LlamaForCausalLM", "generation_defaults", "load_model", "read_generation_config",
           "read_model_config"]
