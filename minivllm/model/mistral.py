"""Mistral: Llama's decoder, where v0.1 limits each query to a sliding window of recent keys."""

from __future__ import annotations

from minivllm.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(hf_config) -> dict:
        """Llama's options and config.json's window (None: v0.2 onwards look back fully)."""
        return {**LlamaForCausalLM.layer_options(hf_config),
                "sliding_window": getattr(hf_config, "sliding_window", None)}
