"""GGUF's blocks multiplied as the file stores them, on a GPU: y = x @ W.T (+ b).

A GGUF layer is uint8 [N, K / weights per block * bytes per block] (quantization/gguf.py): each
output row a run of blocks. Q8_0, Q4_0 and Q4_1 hold 32 weights a block: an fp16 scale d (Q4_1 also
an fp16 minimum m) and their codes, Q8_0 32 signed bytes (w = d q), Q4_0 and Q4_1 16 bytes of
nibbles (w = d (q - 8), w = d q + m), a byte's low nibble weight j, its high nibble j + 16; Q5_0
and Q5_1 (in Q4_K_M files, where a row's length is no multiple of 256) add 4 bytes of fifth bits,
bit j weight j's (w = d (q - 16), w = d q + m).
The "K" formats most downloaded files hold group 256 weights into a super-block of eight sub-blocks
of 32, each with its own small integer scale (quantization/cpu_gguf.cpp draws both layouts):
Q4_K (144 bytes) w = d scale_j q - dmin min_j, Q6_K (210 bytes) w = d scale_i (q - 32), one int8
scale per 16 weights. Each program computes a [BLOCK_M, BLOCK_N] tile of y and walks K 32 weights at
a time: it loads that run of codes of each of its BLOCK_N rows (a few bytes where fp16 weights would
take 64), rebuilds the 32 weights in registers as two halves of 16 (tl.dot's smallest K) and
multiplies x's matching halves, summing in fp32. So a decode step reads the file's bytes, as the
CPU's block kernel does (quantization/cpu_gguf.py). The fp16 scales are read as two bytes and
bit-cast (a block's fields are not 2-byte aligned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_decode import device_arch, small_tiles

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 2, 3, 6, 7, 8, 12, 14  # ggml's type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_WEIGHTS = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}
# the byte where a block's codes start (a Q5 block's fifth bits are the 4 bytes before)
CODES_AT = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, Q8_0: 2, Q4_K: 16, Q6_K: 0}


@triton.jit
def _half_at(ptr, mask):
    """The fp16 at ptr (two little-endian bytes, any alignment), as fp32."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k_scale_min(packed, j, mask):
    """Sub-block j's 6-bit scale and min, as fp32 [BLOCK_N]: j < 4 keeps them in the low 6 bits of
    bytes j and j + 4; j >= 4 keeps their low 4 bits in byte j + 4's nibbles and their top 2 bits
    in the top bits of bytes j - 4 (scale) and j (min)."""
    a = tl.load(packed + j, mask=mask, other=0).to(tl.int32)
    b = tl.load(packed + j + 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(packed + j % 4, mask=mask, other=0).to(tl.int32)  # byte j - 4 when j >= 4
    scale = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    low_min = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), low_min.to(tl.float32)


@triton.jit
def _gguf_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, CODES_AT: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 16)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = n_mask[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]: each row's first block
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, K // 32):  # 32 weights of each row a step: a block, or a K sub-block
        x_low = tl.load(x_rows + b * 32 + half[None, :], mask=m_mask[:, None], other=0.0)
        x_high = tl.load(x_rows + b * 32 + 16 + half[None, :], mask=m_mask[:, None], other=0.0)
        if TYPE == 12:  # Q4_K: sub-block j's nibbles are the low (even j) or high half of 32 bytes
            block, j = w_rows + (b // 8) * BLOCK_BYTES, b % 8
            d, dmin = _half_at(block, n_mask)[None, :], _half_at(block + 2, n_mask)[None, :]
            scale, low_min = _q4_k_scale_min(block + 4, j, n_mask)
            codes = block[:, None] + CODES_AT + (j // 2) * 32 + half[None, :]
            shift = 4 * (j % 2)
            low = tl.trans((tl.load(codes, mask=rows, other=0) >> shift) & 15).to(tl.float32)
            high = tl.trans((tl.load(codes + 16, mask=rows, other=0) >> shift) & 15).to(tl.float32)
            step, offset = d * scale[None, :], dmin * low_min[None, :]
            w_low, w_high = step * low - offset, step * high - offset
        elif TYPE == 14:  # Q6_K: 4 low bits from ql, 2 high bits from qh, an int8 scale per 16
            block, j = w_rows + (b // 8) * BLOCK_BYTES, b % 8
            part, first = j % 4, (j // 4) * 128  # sub-block j: weights 32 part + l of its half
            d = _half_at(block + 208, n_mask)[None, :]
            ql = block[:, None] + (j // 4) * 64 + (part % 2) * 32 + half[None, :]
            qh = block[:, None] + 128 + (j // 4) * 32 + half[None, :]
            low_shift, high_shift = 4 * (part // 2), 2 * part
            scales = block + 192 + (first // 16) + 2 * part
            s_low = tl.load(scales, mask=n_mask, other=0).to(tl.int8, bitcast=True)
            s_high = tl.load(scales + 1, mask=n_mask, other=0).to(tl.int8, bitcast=True)
            q_low = (((tl.load(ql, mask=rows, other=0) >> low_shift) & 15)
                     | (((tl.load(qh, mask=rows, other=0) >> high_shift) & 3) << 4))
            q_high = (((tl.load(ql + 16, mask=rows, other=0) >> low_shift) & 15)
                      | (((tl.load(qh + 16, mask=rows, other=0) >> high_shift) & 3) << 4))
            w_low = (d * s_low.to(tl.float32)[None, :]) * (tl.trans(q_low).to(tl.float32) - 32.0)
            w_high = (d * s_high.to(tl.float32)[None, :]) * (tl.trans(q_high).to(tl.float32) - 32.0)
        else:
            block = w_rows + b * BLOCK_BYTES
            d = _half_at(block, n_mask)[None, :]
            codes = block[:, None] + CODES_AT + half[None, :]  # [BLOCK_N, 16]: contiguous
            if TYPE == 8:  # Q8_0: the 32 bytes in order, signed
                low = tl.load(codes, mask=rows, other=0).to(tl.int8, bitcast=True)
                high = tl.load(codes + 16, mask=rows, other=0).to(tl.int8, bitcast=True)
                w_low, w_high = tl.trans(low.to(tl.float32)) * d, tl.trans(high.to(tl.float32)) * d
            else:
                nibbles = tl.trans(tl.load(codes, mask=rows, other=0))  # [16, BLOCK_N]
                low, high = (nibbles & 15).to(tl.int32), (nibbles >> 4).to(tl.int32)
                if TYPE == 6 or TYPE == 7:  # Q5: bit j of the 32-bit word before the nibbles
                    fifth = block + CODES_AT - 4
                    word = (tl.load(fifth, mask=n_mask, other=0).to(tl.int32)
                            | (tl.load(fifth + 1, mask=n_mask, other=0).to(tl.int32) << 8)
                            | (tl.load(fifth + 2, mask=n_mask, other=0).to(tl.int32) << 16)
                            | (tl.load(fifth + 3, mask=n_mask, other=0).to(tl.int32) << 24))
                    low = low | (((word[None, :] >> half[:, None]) & 1) << 4)
                    high = high | (((word[None, :] >> (half[:, None] + 16)) & 1) << 4)
                low, high = low.to(tl.float32), high.to(tl.float32)
                if TYPE == 2 or TYPE == 6:  # Q4_0, Q5_0: an offset of 8 (16)
                    offset = 8.0 if TYPE == 2 else 16.0
                    w_low, w_high = (low - offset) * d, (high - offset) * d
                else:  # Q4_1, Q5_1: the block's minimum added
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
    per_block = BLOCK_WEIGHTS[ggml_type]
    assert blocks.dtype == torch.uint8 and blocks.stride(-1) == 1 and k % per_block == 0
    assert blocks.shape == (n, k // per_block * BLOCK_BYTES[ggml_type])
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
    if ggml_type in (Q4_K, Q6_K):
        return _dequantize_super_blocks(blocks, ggml_type, n, k)
    block = blocks.view(n, k // 32, BLOCK_BYTES[ggml_type])
    d = _halves(block[..., 0:2])  # [n, blocks, 1]
    codes = block[..., CODES_AT[ggml_type]:]
    if ggml_type == Q8_0:
        return (d * codes.view(torch.int8).float()).reshape(n, k)
    q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # low nibbles first, as stored
    if ggml_type in (Q5_0, Q5_1):  # fifth bits: bit j of the little-endian word before the codes
        word = block[..., CODES_AT[ggml_type] - 4:CODES_AT[ggml_type]].to(torch.int64)
        word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
        q = q + 16 * ((word[..., None] >> torch.arange(32, device=blocks.device)) & 1).float()
    if ggml_type in (Q4_0, Q5_0):
        return (d * (q - (8 if ggml_type == Q4_0 else 16))).reshape(n, k)
    return (d * q + _halves(block[..., 2:4])).reshape(n, k)


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [..., 1] their fp16 values as fp32."""
    return pairs.contiguous().view(torch.float16).float()


def _dequantize_super_blocks(blocks: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """Q4_K or Q6_K as fp32 [n, k]: each super-block's eight sub-blocks of 32, as the kernel
    builds them."""
    block = blocks.view(n, k // 256, BLOCK_BYTES[ggml_type]).to(torch.int32)
    if ggml_type == Q4_K:
        raw = blocks.view(n, k // 256, 144)
        d, dmin = _halves(raw[..., 0:2]), _halves(raw[..., 2:4])
        # sub-block j's bytes j, j + 4 and j % 4 of the packed scales (see _q4_k_scale_min)
        a, b, c = block[..., 4:12], block[..., 8:16], block[..., 4:8].repeat(1, 1, 2)
        low = torch.arange(8, device=blocks.device) < 4
        scale = torch.where(low, a & 63, (b & 15) | ((c >> 6) << 4)).float()  # [n, blocks, 8]
        low_min = torch.where(low, b & 63, (b >> 4) | ((a >> 6) << 4)).float()
        codes = block[..., 16:].view(n, k // 256, 4, 1, 32)
        q = torch.cat([codes & 15, codes >> 4], dim=3).view(n, k // 256, 8, 32).float()
        w = (d * scale)[..., None] * q - (dmin * low_min)[..., None]
        return w.reshape(n, k)
    d = _halves(blocks.view(n, k // 256, 210)[..., 208:210])[..., None]  # [n, blocks, 1, 1]
    ql = block[..., 0:128].view(n, k // 256, 2, 2, 32)
    qh = block[..., 128:192].view(n, k // 256, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3)  # [n, blocks, half, part, 32]: parts 2, 3 high
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)
    q = (low | (high << 4)).float() - 32
    scales = blocks.view(n, k // 256, 210)[..., 192:208].contiguous().view(torch.int8).float()
    scales = scales.view(n, k // 256, 2, 4, 2).repeat_interleave(16, dim=-1)  # one per 16 weights
    return ((d[..., None] * scales) * q).reshape(n, k)
