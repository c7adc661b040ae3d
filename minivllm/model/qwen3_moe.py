"""Qwen3-MoE: Qwen3's decoder (RMSNorm on each head of q and k) with experts on its sparse layers.

No shared expert; the router renormalises its top k where `norm_topk_prob` (the released models
do); `decoder_sparse_step` and `mlp_only_layers` leave some layers dense (qwen2_moe.py's rule).
"""

from __future__ import annotations

from minivllm.model.qwen2_moe import qwen_moe_options
from minivllm.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**Qwen3ForCausalLM.layer_options(hf_config), **qwen_moe_options(hf_config)}
