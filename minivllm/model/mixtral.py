"""Mixtral: Mistral's decoder whose every MLP is a mixture of experts (model/moe_layer.py).

Its router softmaxes over all experts, keeps the top k and always rescales them to sum to 1;
its checkpoints name the sparse MLP `block_sparse_moe` and an expert's gate, down and up `w1`, `w2`
and `w3`, and its `intermediate_size` is each expert's.
"""

from __future__ import annotations

from minivllm.model.mistral import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @staticmethod
    def layer_options(hf_config) -> dict:
        """Mistral's options (its sliding window), and experts on every layer."""
        return {**MistralForCausalLM.layer_options(hf_config),
                "num_experts": hf_config.num_local_experts,
                "num_experts_per_tok": hf_config.num_experts_per_tok,
                "moe_intermediate_size": hf_config.intermediate_size,
                "norm_topk_prob": True, "moe_layers": None}
