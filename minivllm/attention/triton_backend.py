"""The Triton backend: TorchAttentionBackend's contract, done by the kernels in minivllm.kernels.

Store the step's K/V, then one kernel launch per layer: the decode kernel when every request brings
a single token (the common steady state, memory bound), the prefill kernel otherwise (prompts,
chunks, mixed batches). An fp8 cache is converted by bit manipulation inside the kernels
(kernels/fp8.py), so it runs on every GPU, a T4 included. On CPU only Triton's interpreter runs
them, slow but exact (tests use it on machines without a GPU: platforms/cuda.py).
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.kernels import interpreted, paged_decode_attention, paged_prefill_attention, store_kv


def check_device(device: str | torch.device) -> None:
    """Fail early and clearly where the kernels cannot run, not deep inside a Triton launch."""
    device = torch.device(device)
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return
    if device.type == "cpu":
        raise ValueError("the Triton attention backend needs a CUDA device; on CPU use "
                         "attention_backend='torch', or set TRITON_INTERPRET=1 before triton is "
                         "first imported (slow: for testing)")
    raise ValueError(f"the Triton attention backend does not support device {device}; use 'torch'")


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self._checked: torch.device | None = None
        if device is not None:
            check_device(device)
            self._checked = torch.device(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
        if self._checked is None or q.device.type != self._checked.type:  # not on every call
            check_device(q.device)
            self._checked = q.device
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_decode_only:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                          scale, max_seq_len=meta.max_seq_len,
                                          num_splits=meta.num_splits, k_scale=k_scale,
                                          v_scale=v_scale, sliding_window=sliding_window)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, scale, meta.max_query_len, k_scale=k_scale,
                                       v_scale=v_scale, sliding_window=sliding_window)
