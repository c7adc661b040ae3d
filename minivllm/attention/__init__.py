"""Attention over the paged KV cache: metadata shared by every backend, and the backends themselves."""

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(name: str, device: str, online_softmax_update=None) -> AttentionBackend:
    """"auto" is Triton on CUDA and the torch backend elsewhere (on CPU with its compiled kernel, cpu_kernel.py).
    `online_softmax_update`: a learner's own (minivllm.hooks): the torch reference then attends decode steps block
    by block with it (online_softmax.py)."""
    if online_softmax_update is not None:
        from minivllm.attention.online_softmax import OnlineSoftmaxBackend

        return OnlineSoftmaxBackend(online_softmax_update)
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        return TorchAttentionBackend(device, fast=True)
    if name == "triton":
        from minivllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
