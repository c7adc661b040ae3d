"""Attention over the paged KV cache: the metadata every backend reads, the interface, the torch
reference, and beside it the CPU's C++ backend (cpu_attention.py) and the Triton one
(triton_backend.py); a platform (minivllm/platforms/) chooses which one a model gets."""

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
