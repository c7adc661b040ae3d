"""vLLM's `vllm.v1.sample.logits_processor`: the interface lives in
minivllm/sampling/logits_processor.py, the row bookkeeping in
minivllm/sampling/persistent_batch.py."""

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
