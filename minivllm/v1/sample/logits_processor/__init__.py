"""vLLM's `vllm.v1.sample.logits_processor` (sampling/logits_processor.py)."""

from minivllm.sampling.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    MoveDirectionality,
    RequestLogitsProcessor,
    process_dict_updates,
)

__all__ = ["AdapterLogitsProcessor", "BatchUpdate", "BatchUpdateBuilder", "LogitsProcessor",
           "MoveDirectionality", "RequestLogitsProcessor", "process_dict_updates"]
