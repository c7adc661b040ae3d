"""Turning logits into tokens: the batched sampler, and speculative decoding's rejection sampler."""

from minivllm.sampling.sampler import Sampler, SamplingBatch

__all__ = ["Sampler", "SamplingBatch"]
