"""Weight-only int8 matmul: y = (x @ q.T) * s + b, with q int8 [N, K] and one scale per output.

Each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in BLOCK_K steps: it loads a tile of
x (fp16/bf16/fp32), a tile of q as int8 (a quarter of fp32's bytes, half of fp16's: the point,
since small batches are bound by reading weights), converts q to x's dtype in registers (exact:
|q| <= 127) and accumulates tl.dot in fp32. The per-channel scale factors out of the sum, so it is
applied once, at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_decode import device_arch, small_tiles


@triton.jit
def _int8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                        stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # q read as [BLOCK_K, BLOCK_N]: W.T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc += tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int8_linear_config(num_tokens: int, dtype: torch.dtype, arch: int | None = None) -> dict:
    """Constexprs and launch options, also compiled by tests/test_aot_compile.py. Tiles no taller
    than the batch (tl.dot wants >= 16 rows): decode batches read each weight tile once for 16 rows.
    Tiles are 32 wide where 64 spill (`small_tiles`: sm_75, fp32)."""
    small = small_tiles(arch, dtype)
    tile = 32 if small else 64
    return dict(BLOCK_M=min(tile, max(16, triton.next_power_of_2(num_tokens))), BLOCK_N=tile,
                BLOCK_K=tile, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=4, num_stages=2 if small else 3)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float, q [N, K] int8, scale [N] -> x @ (q * scale[:, None]).T + bias (x's dtype)"""
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert q.dtype == torch.int8 and q.stride(-1) == 1 and x.shape[-1] == q.shape[1]
    m, n = x.shape[0], q.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = int8_linear_config(m, x.dtype, device_arch(x.device))
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _int8_linear_kernel[grid](x, q, scale, bias if bias is not None else scale, out, m, n,
                              x.shape[1], x.stride(0), q.stride(0), out.stride(0),
                              HAS_BIAS=bias is not None, **config)
    return out
