"""The Llama-family decoder (Llama, TinyLlama, Mistral, Qwen2, Qwen3) and its Hugging Face
loader."""

from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import (
    generation_defaults,
    load_model,
    read_generation_config,
    read_model_config,
)

__all__ = ["LlamaForCausalLM", "generation_defaults", "load_model", "read_generation_config",
           "read_model_config"]
