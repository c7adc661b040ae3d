"""The decoder layer's small ops, readable torch: RMSNorm (with the residual add), rotary, SwiGLU.

The model (llama.py) calls them through a `LayerOps` bundle, so that a platform
(minivllm/platforms/) can hand it fused kernels with the same contracts instead: the CPU's C++ ops
(cpu_layer_ops.py) or the Triton kernels (minivllm/kernels/). `REFERENCE` is what the chapters
teach, and the oracle the fused ops are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class LayerOps(NamedTuple):
    """One implementation of each small op a decoder layer runs."""

    # (x, weight, eps, residual | None) -> (norm(x [+ residual]), x + residual | None)
    rms_norm: Callable
    rotary: Callable  # (positions, q, k, cos_sin table) -> (q, k) rotated
    silu_and_mul: Callable  # gate_up [T, 2I] -> silu(gate) * up [T, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x), None), or with `residual`: (norm(x + residual), x + residual), the add deferred
    from the layer before. Normalised in fp32, rounded back to x's dtype before the weight
    multiplies it (as HF)."""
    if residual is not None:
        x = residual = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, dim], k [T, kv_heads, dim], each token rotated by its own position's row of the
    fp32 table `cos_sin` [max_positions, 2, dim]."""
    cos, sin = cos_sin[positions].to(q.dtype).unsqueeze(2).unbind(1)  # [T, 1, dim] each
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]: SwiGLU's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


REFERENCE = LayerOps(rms_norm=rms_norm, rotary=rotary, silu_and_mul=silu_and_mul)
