"""Qwen2: Llama's decoder with a bias on q, k and v."""

from __future__ import annotations

from minivllm.model.llama import LlamaForCausalLM


def qwen_window(hf_config) -> int | None:
    """Qwen configs carry a `sliding_window` that is off unless `use_sliding_window` turns it on."""
    if not getattr(hf_config, "use_sliding_window", False):
        return None
    return getattr(hf_config, "sliding_window", None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**LlamaForCausalLM.layer_options(hf_config), "qkv_bias": True,
                "sliding_window": qwen_window(hf_config)}
