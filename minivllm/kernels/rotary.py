"""Rotary position embedding of q and k in one kernel launch per layer.

The torch version indexes the cos/sin table, casts it, slices each head into halves, negates,
concatenates, multiplies and adds: around a dozen kernels for q and k. Here one program per token
loads its cos/sin row once and rotates each pair (x1, x2) of half-dimensions of every head:

    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin

The table is the model's `cos_sin` buffer, [max_positions, 2, head_dim] in fp32, whose two halves
repeat (the frequencies are concatenated twice, as in Hugging Face's rotate_half convention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_st, stride_sh, stride_dt, stride_dh, t, num_heads, half,
                  cos, sin, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < half)
    src = src_ptr + t.to(tl.int64) * stride_st + heads[:, None] * stride_sh + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + t.to(tl.int64) * stride_dt + heads[:, None] * stride_dh + offs[None, :]
    dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(dst + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
    num_q_heads, num_k_heads, half,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * (4 * half)  # [2, head_dim] per position: cos then sin
    cos = tl.load(row + offs, mask=offs < half, other=0.0)
    sin = tl.load(row + 2 * half + offs, mask=offs < half, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_oqt, stride_oqh, t, num_q_heads,
                  half, cos, sin, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_okt, stride_okh, t, num_k_heads,
                  half, cos, sin, BLOCK_KH, BLOCK_HALF)


def rotary_config(num_q_heads: int, num_k_heads: int, head_dim: int) -> dict:
    """Constexprs, shared with the ahead-of-time compile test (tests/test_aot_compile.py)."""
    return dict(BLOCK_QH=triton.next_power_of_2(num_q_heads),
                BLOCK_KH=triton.next_power_of_2(num_k_heads),
                BLOCK_HALF=triton.next_power_of_2(head_dim // 2))


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, dim], k [T, kv_heads, dim] (last dim contiguous), positions [T] -> new q, k."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos_sin.is_contiguous() and cos_sin.dtype == torch.float32
    num_tokens, num_q_heads, head_dim = q.shape
    assert head_dim % 2 == 0 and cos_sin.shape[-1] == head_dim
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            num_q_heads, k.shape[1], head_dim // 2,
            **rotary_config(num_q_heads, k.shape[1], head_dim))
    return q_out, k_out
