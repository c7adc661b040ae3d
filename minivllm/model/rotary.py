"""Rotary position embedding (RoPE), with the llama3 frequency scaling some checkpoints use.

The module owns the cos/sin table; the rotation itself is `rotate`, from the model's LayerOps
(layer_ops.py: the readable torch one, or a platform's fused kernel reading the table and the
positions itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from minivllm.model.layer_ops import rotary


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """One rotation frequency per pair of dimensions; llama3 scaling slows the low ones down,
    linear scaling (Gemma 3's global layers) all of them by its factor."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv_freq / scaling["factor"]
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, inv_freq)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 rotate: Callable = rotary) -> None:
        """`rotate(positions, q, k, cos_sin)`: the rotation of q and k (LayerOps.rotary)."""
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, 2, head_dim), persistent=False)
        self.rotate = rotate

    def build(self) -> None:
        """Fill the cos/sin table (after the module lands on its device)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.cos_sin.device)
        pos = torch.arange(self.max_positions, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, dim], k: [T, kv_heads, dim]; each token rotated by its own position."""
        return self.rotate(positions, q, k, self.cos_sin)
