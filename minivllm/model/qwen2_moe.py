"""Qwen2-MoE: Qwen2's decoder (bias on q, k, v) with experts on some layers and a shared expert.

Each sparse layer adds to its routed experts an always-on shared expert, scaled per token by
sigmoid(shared_expert_gate(x)); its router renormalises the top k only where `norm_topk_prob`.
"""

from __future__ import annotations

from minivllm.model.qwen2 import Qwen2ForCausalLM


def qwen_moe_options(hf_config) -> dict:
    """The Qwen MoE families' experts: a layer is sparse unless `mlp_only_layers` lists it, and only
    every `decoder_sparse_step`-th layer (transformers' rule: (i + 1) % step == 0)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0)
    step, dense = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    return {"num_experts": experts, "num_experts_per_tok": hf_config.num_experts_per_tok,
            "moe_intermediate_size": hf_config.moe_intermediate_size,
            "norm_topk_prob": bool(hf_config.norm_topk_prob),
            "moe_layers": tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                for i in range(hf_config.num_hidden_layers))}


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**Qwen2ForCausalLM.layer_options(hf_config),
                "qkv_bias": bool(getattr(hf_config, "qkv_bias", True)),
                **qwen_moe_options(hf_config),
                "shared_expert_intermediate_size": hf_config.shared_expert_intermediate_size}
