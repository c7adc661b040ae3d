"""The attention backend interface: what each decoder layer asks of any attention implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str  # "torch", "cpu", "triton", "torch-online-softmax": for logs and tests, not decisions

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
        """Store the step's new K/V ([T, kv_heads, dim]) in their cache slots, then attend each new
        query ([T, heads, dim]) over its request's whole context (with a `sliding_window` w: its w
        latest keys, its own included); returns [T, heads, dim]. An fp8 cache stores K / k_scale
        and V / v_scale and reads them back times the scale; a float cache ignores them."""
        ...
