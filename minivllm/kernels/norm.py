"""RMSNorm, optionally fused with the residual add before it: one pass per row, not about seven.

In torch, `norm(x + residual)` is an add, a cast to fp32, a square, a mean, an rsqrt, two multiplies
and a cast back: each a kernel that reads and writes the whole activation, for a decode batch tiny
kernels whose cost is mostly their launch, a dozen times per layer. Here one program per row:

    residual_out = x + residual          (rounded to the model's dtype, as the unfused model does)
    out          = weight * (residual_out / sqrt(mean(residual_out^2) + eps))

The same kernel normalises each head of q and k (Qwen3's q_norm / k_norm): rows are (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
    num_heads, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)  # token
    h = tl.program_id(1)  # head (0 when normalising whole hidden states)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # x and residual are [T, dim]: h is always 0 here
        r = tl.load(residual_ptr + t.to(tl.int64) * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + t.to(tl.int64) * stride_ot + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = w * (xf * inv_rms).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs, y, mask=mask)


def rms_norm_config(dim: int, has_residual: bool) -> dict:
    """Constexprs, shared with the ahead-of-time compile test (tests/test_aot_compile.py)."""
    return dict(HAS_RESIDUAL=has_residual, BLOCK_D=triton.next_power_of_2(dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, dim] or [T, heads, dim] (last dim contiguous) -> (normalised x, x + residual or None):
    with `residual` ([T, dim]), the sum is normalised and returned as the new residual."""
    assert x.stride(-1) == 1 and x.shape[-1] == weight.shape[0]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    num_tokens, num_heads, dim = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
        residual_out = torch.empty_like(out[:, 0])
    if num_tokens:
        _rms_norm_kernel[(num_tokens, num_heads)](
            x3, residual if residual is not None else x3, weight, out,
            residual_out if residual_out is not None else out,
            x3.stride(0), x3.stride(1), residual.stride(0) if residual is not None else 0,
            out.stride(0), out.stride(1),
            num_heads, dim, eps,
            **rms_norm_config(dim, residual is not None),
        )
    return out.view(x.shape), residual_out
