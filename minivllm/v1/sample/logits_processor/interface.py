"""vLLM's `vllm.v1.sample.logits_processor.interface`: see minivllm/sampling/logits_processor.py."""

from minivllm.sampling.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest",
           "RemovedRequest"]
