"""Attention over the paged KV cache: metadata shared by every backend, and the backends themselves."""

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """"auto" is Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from minivllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
