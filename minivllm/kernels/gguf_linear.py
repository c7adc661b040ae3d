"""GGUF's 32-weight blocks multiplied as the file stores them, on a GPU: y = x @ W.T (+ b).

A GGUF layer is uint8 [N, K / 32 * bytes per block] (quantization/gguf.py): each output row a run
of blocks, each block an fp16 scale d (Q4_1 also an fp16 minimum m) and its 32 weights' codes:
Q8_0 32 signed bytes (w = d q), Q4_0 and Q4_1 16 bytes of nibbles (w = d (q - 8), w = d q + m),
a byte's low nibble weight j and its high nibble weight j + 16. Each program computes a
[BLOCK_M, BLOCK_N] tile of y and walks K one block at a time: it loads the block of each of its
BLOCK_N rows (18-34 bytes where fp16 weights would take 64), rebuilds the 32 weights in registers
as two halves of 16 (tl.dot's smallest K) and multiplies x's matching halves, summing in fp32.
So a decode step reads the file's bytes, as the CPU's block kernel does (quantization/cpu_gguf.py).
The fp16 scales are read as two bytes and bit-cast (a block's fields are not 2-byte aligned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_decode import device_arch, small_tiles

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml's type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
CODES_AT = {Q4_0: 2, Q4_1: 4, Q8_0: 2}  # the byte where a block's weight codes start


@triton.jit
def _half_at(ptr, mask):
    """The fp16 at ptr (two little-endian bytes, any alignment), as fp32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, CODES_AT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 16)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]: each row's first block
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, K // 32):
        x_low = tl.load(x_rows + b * 32 + half[None, :], mask=m_mask[:, None], other=0.0)
        x_high = tl.load(x_rows + b * 32 + 16 + half[None, :], mask=m_mask[:, None], other=0.0)
        block = w_rows + b * BLOCK_BYTES
        d = _half_at(block, n_mask)[None, :]
        codes = block[:, None] + CODES_AT + half[None, :]  # [BLOCK_N, 16]: contiguous in each row
        if TYPE == 8:  # Q8_0: the 32 bytes in order, signed
            low = tl.load(codes, mask=n_mask[:, None], other=0).to(tl.int8, bitcast=True)
            high = tl.load(codes + 16, mask=n_mask[:, None], other=0).to(tl.int8, bitcast=True)
            w_low, w_high = tl.trans(low.to(tl.float32)) * d, tl.trans(high.to(tl.float32)) * d
        else:
            nibbles = tl.trans(tl.load(codes, mask=n_mask[:, None], other=0))  # [16, BLOCK_N]
            low, high = (nibbles & 15).to(tl.float32), (nibbles >> 4).to(tl.float32)
            if TYPE == 2:  # Q4_0: an offset of 8
                w_low, w_high = (low - 8.0) * d, (high - 8.0) * d
            else:  # Q4_1: the block's minimum added
                m = _half_at(block + 2, n_mask)[None, :]
                w_low, w_high = low * d + m, high * d + m
        acc += tl.dot(x_low, w_low.to(x_low.dtype), input_precision=DOT_PRECISION)
        acc += tl.dot(x_high, w_high.to(x_high.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_linear_config(num_tokens: int, ggml_type: int, dtype: torch.dtype,
                       arch: int | None = None) -> dict:
    """Constexprs and launch options, also compiled by tests/test_aot_compile.py: tiles no taller
    than the batch (>= 16 rows for tl.dot), 32 wide where 64 would spill (`small_tiles`)."""
    small = small_tiles(arch, dtype)
    return dict(TYPE=ggml_type, BLOCK_BYTES=BLOCK_BYTES[ggml_type], CODES_AT=CODES_AT[ggml_type],
                BLOCK_M=min(32 if small else 64, max(16, triton.next_power_of_2(num_tokens))),
                BLOCK_N=32 if small else 64,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", num_warps=4,
                num_stages=2 if small else 3)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float, blocks uint8 [n, K / 32 * bytes] of `ggml_type` -> x @ W.T + bias."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    assert blocks.dtype == torch.uint8 and blocks.stride(-1) == 1 and k % 32 == 0
    assert blocks.shape == (n, k // 32 * BLOCK_BYTES[ggml_type])
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = gguf_linear_config(m, ggml_type, x.dtype, device_arch(x.device))
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _gguf_linear_kernel[grid](x, blocks, bias if bias is not None else x, out, m, n, k, x.stride(0),
                              blocks.stride(0), out.stride(0), HAS_BIAS=bias is not None, **config)
    return out


def dequantize_blocks(blocks: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """W [n, k] fp32 from its blocks, in torch on the blocks' device (the kernel's reference, and a
    tied embedding's rows): the formulas above, block by block."""
    block = blocks.view(n, k // 32, BLOCK_BYTES[ggml_type])
    d = block[..., 0:2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    codes = block[..., CODES_AT[ggml_type]:]
    if ggml_type == Q8_0:
        return (d * codes.view(torch.int8).float()).reshape(n, k)
    q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # low nibbles first, as stored
    if ggml_type == Q4_0:
        return (d * (q - 8)).reshape(n, k)
    return (d * q + block[..., 2:4].contiguous().view(torch.float16).float()).reshape(n, k)
