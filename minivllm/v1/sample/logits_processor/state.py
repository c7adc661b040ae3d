"""vLLM's `vllm.v1.sample.logits_processor.state`: see minivllm/sampling/logits_processor.py."""

from minivllm.sampling.logits_processor import BatchUpdateBuilder

__all__ = ["BatchUpdateBuilder"]
