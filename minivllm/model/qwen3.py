"""Qwen3: Llama's decoder with an RMSNorm on each head of q and k, before the rotation."""

from __future__ import annotations

from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.qwen2 import qwen_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**LlamaForCausalLM.layer_options(hf_config), "qk_norm": True,
                **qwen_window(hf_config)}
