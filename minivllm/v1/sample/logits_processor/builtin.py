"""vLLM's `...logits_processor.builtin`: `process_dict_updates` (its processors: sampler steps)."""

from minivllm.sampling.logits_processor import process_dict_updates

__all__ = ["process_dict_updates"]
