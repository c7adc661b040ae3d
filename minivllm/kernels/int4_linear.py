"""4-bit dequantizing matmul for GPTQ and AWQ weights: y = x @ W + b, W [K, N] rebuilt tile by tile.

The weight stays as the checkpoint's 4-bit words (GPTQ's layout: eight consecutive inputs per int32,
so AWQ checkpoints are repacked once at load), a zero point per group and output (a byte) and a
scale (x's dtype). Per BLOCK_K step a program loads x's tile, the words covering BLOCK_K inputs,
shifts each input's nibble out (q = word >> 4 * (k % 8) & 15), and rebuilds W = (q - z) * s for its
one group (BLOCK_K divides the group size), then accumulates tl.dot in fp32. Reading half a byte per
weight instead of two is what makes small batches faster; the extra arithmetic hides under the
loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_decode import device_arch, small_tiles


@triton.jit
def _int4_linear_kernel(x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_xm, stride_qk, stride_zg, stride_sg, stride_om,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    shifts = (offs_k % 8) * 4  # input k sits in nibble k % 8 of word k // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K
        kk = k0 + offs_k
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        words = tl.load(qweight_ptr + (kk // 8)[:, None] * stride_qk + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
        q = (words >> shifts[:, None]) & 0xF
        group = k0 // GROUP
        z = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_mask, other=0).to(tl.float32)
        s = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_linear_config(num_tokens: int, group: int, dtype: torch.dtype,
                       arch: int | None = None) -> dict:
    """Constexprs and launch options, also compiled by tests/test_aot_compile.py. BLOCK_K divides
    the group (each step needs one row of zero points and scales) and is >= 16 (tl.dot): the group
    must be a multiple of 16. Tiles are 32 wide where 64 spill (`small_tiles`)."""
    assert group % 16 == 0, "the Triton 4-bit kernel needs groups of a multiple of 16 inputs"
    small = small_tiles(arch, dtype)
    tile = 32 if small else 64
    block_k = 64 if group % 64 == 0 and not small else 32 if group % 32 == 0 else 16
    return dict(GROUP=group, BLOCK_M=min(tile, max(16, triton.next_power_of_2(num_tokens))),
                BLOCK_N=tile, BLOCK_K=block_k,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=4,
                num_stages=2 if small else 3)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K]; qweight int32 [K/8, N]; zeros uint8, scales [K/G, N] -> x @ ((q - z) * s) + b."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k, n = x.shape[0], x.shape[1], qweight.shape[1]
    assert qweight.shape[0] * 8 == k and k % group == 0
    assert scales.shape == zeros.shape == (k // group, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = int4_linear_config(m, group, x.dtype, device_arch(x.device))
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _int4_linear_kernel[grid](x, qweight, zeros, scales, bias if bias is not None else scales, out,
                              m, n, k, x.stride(0), qweight.stride(0), zeros.stride(0),
                              scales.stride(0), out.stride(0), HAS_BIAS=bias is not None, **config)
    return out
