"""Rotary position embedding (RoPE), with the llama3 frequency scaling some checkpoints use."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """One rotation frequency per pair of dimensions; llama3 scaling slows the low frequencies down."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 kernel: Callable | None = None) -> None:
        """`kernel`: the backend's fused rotation of q and k, `kernel(positions, q, k, cos_sin)`
        (minivllm/kernels/rotary.py, model/cpu_layer_ops.py); None rotates with the torch ops below."""
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, 2, head_dim), persistent=False)
        self.kernel = kernel

    def build(self) -> None:
        """Fill the cos/sin table (after the module lands on its device)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.cos_sin.device)
        pos = torch.arange(self.max_positions, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer needs to rotate this step's tokens, looked up once per step rather than per layer:
        each token's cos and sin rows [T, 1, dim] (the fused kernel reads the positions and the table itself)."""
        if self.kernel is not None:
            return positions, self.cos_sin
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(2).unbind(1)
        return cos, sin

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, dim], k: [T, kv_heads, dim]; each token rotated by its own position (`rope` from
        for_positions)."""
        if self.kernel is not None:
            positions, table = rope
            return self.kernel(positions, q, k, table)
        cos, sin = rope
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
