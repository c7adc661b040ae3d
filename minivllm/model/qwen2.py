"""Qwen2: Llama's decoder with a bias on q, k and v."""

from __future__ import annotations

from minivllm.model.llama import LlamaForCausalLM


def qwen_window(hf_config) -> dict:
    """Qwen configs carry a `sliding_window` that is off unless `use_sliding_window` turns it on,
    and then only on the layers from `max_window_layers` on (transformers' `layer_types`)."""
    window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", False) or window is None:
        return {"sliding_window": None, "sliding_layers": None}
    first = getattr(hf_config, "max_window_layers", 0)
    types = getattr(hf_config, "layer_types", None) or [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(hf_config.num_hidden_layers)]
    return {"sliding_window": window,
            "sliding_layers": tuple(kind == "sliding_attention" for kind in types)}


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**LlamaForCausalLM.layer_options(hf_config), "qkv_bias": True,
                **qwen_window(hf_config)}
