"""vLLM's `vllm.v1.sample.logits_processor.builtin`, for its helper `process_dict_updates`. (vLLM's
built-in processors, min_tokens, logit_bias and min_p, are steps of minivllm's sampler:
sampling/sampler.py.)"""

from minivllm.sampling.logits_processor import process_dict_updates

__all__ = ["process_dict_updates"]
