"""Which module builds which checkpoint: the registry of model families.

A family is one module under model/ that declares its decoder from the shared parts (llama.py's
norm, attention, MLP and decoder layer) and says what its layers read from the checkpoint's config
(`layer_options`). This table maps config.json's `architectures` name to that module and class;
the loader, runner, engine and platforms never name a family. Modules are imported on first use,
so listing a family costs nothing until a checkpoint asks for it.
"""

from __future__ import annotations

import importlib

from torch import nn

# config.json's `architectures` -> (module under minivllm.model, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}
# a config without `architectures` (one written from a bare LlamaConfig, a GGUF file's) is read by
# its model_type
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def architecture_of(hf_config, where: str = "") -> str:
    """The registry key of a transformers config; a ValueError naming what is not supported and
    listing what is."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in BY_MODEL_TYPE:
        names = [BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in ARCHITECTURES:
            return name
    asked = names or [f"model_type {getattr(hf_config, 'model_type', None)!r}"]
    raise ValueError(f"{where}: architecture {', '.join(map(str, asked))} is not supported "
                     f"(supported: {', '.join(ARCHITECTURES)})")


def model_class(architecture: str) -> type[nn.Module]:
    """The decoder class registered for `architecture` (its module imported now)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"minivllm.model.{module}"), name)
