"""The attention backend interface: what every decoder layer asks of its attention, whoever implements it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from minivllm.attention.metadata import AttentionMetadata


class LayerKernels(NamedTuple):
    """Fused stand-ins a backend may bring for the decoder layer's chains of small torch ops (model/llama.py):
    the Triton kernels (minivllm/kernels/) or the CPU's C++ ops (model/cpu_layer_ops.py)."""

    rms_norm: Callable  # (x, weight, eps, residual | None) -> (norm(x [+ residual]), x + residual | None)
    apply_rotary: Callable  # (positions, q, k, cos_sin table) -> (q, k) rotated
    silu_and_mul: Callable  # gate_up [T, 2I] -> silu(gate) * up [T, I]


class AttentionBackend(Protocol):
    name: str  # "torch", "triton": CUDA graphs are only captured for backends whose kernels allow it
    layer_kernels: LayerKernels | None  # None: the layers run their readable torch ops

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """Store the step's new K/V ([T, kv_heads, dim]) in their cache slots, then attend each new query
        ([T, heads, dim]) over its request's whole context; returns [T, heads, dim]. An fp8 cache stores
        K / k_scale and V / v_scale and reads them back times the scale; a float cache ignores the scales."""
        ...
