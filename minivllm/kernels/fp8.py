"""fp8 KV cache elements in Triton, converted by bit manipulation so that every GPU runs them.

Triton's own fp8 conversions need hardware a T4 lacks (e4m3 needs sm_89+), so the kernels treat an
fp8 cache as bytes and convert with integer ops: a handful per element, on a memory-bound load. One
code path for sm_75, sm_80 and sm_90, and the same bits as torch's casts (tests/test_fp8_kv.py).

Reading is a shift: an fp8 byte is the top of an fp16 bit pattern. e5m2 has fp16's exponent (5 bits,
bias 15) and the first 2 of its mantissa bits, so `byte << 8` is the same value. e4m3 has a 4-bit
exponent (bias 7): put its 7 exponent and mantissa bits below fp16's sign and the fp16 is the value
/ 2**(15 - 7), subnormals included; the kernels fold that 256 into their scale (`dequant_factor`).

Writing rounds to nearest, ties to even, as torch's cast does: normal values by rounding the fp32
mantissa bits; values below the format's smallest normal by adding a power of two whose last
mantissa bit is the format's smallest step, so the float adder does the rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the kernels' KV_FP8 constexpr: how the cache stores its elements
KV_FLOAT, KV_E4M3, KV_E5M2 = 0, 1, 2
_FORMATS = {torch.float8_e4m3fn: KV_E4M3, torch.float8_e5m2: KV_E5M2}


def kv_format(cache_dtype: torch.dtype) -> int:
    """KV_FLOAT for a float cache, else the fp8 format's id."""
    return _FORMATS.get(cache_dtype, KV_FLOAT)


def dequant_factor(fmt: int, scale: float) -> float:
    """What `fp8_to_half`'s result is multiplied by: the scale (times 256 for e4m3, see above)."""
    return scale * (256.0 if fmt == KV_E4M3 else 1.0)


@triton.jit
def fp8_to_half(bits, KV_FP8: tl.constexpr):
    """fp8 bytes (uint8) -> fp16: the value for e5m2, the value / 256 for e4m3."""
    b = bits.to(tl.uint16)
    if KV_FP8 == 1:
        b = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    else:
        b = b << 8
    return b.to(tl.float16, bitcast=True)


@triton.jit
def float_to_fp8(x, KV_FP8: tl.constexpr):
    """fp32 -> fp8 bytes (uint8), saturating at the format's largest value."""
    if KV_FP8 == 1:
        # e4m3: bias 7, 3 mantissa bits; 2**14: steps of 2**-9
        return _round_to_fp8(x, 7, 3, 448.0, 16384.0)
    else:
        # e5m2: bias 15, 2 mantissa bits; 2**7: steps of 2**-16
        return _round_to_fp8(x, 15, 2, 57344.0, 128.0)


@triton.jit
def _round_to_fp8(x, BIAS: tl.constexpr, MANTISSA: tl.constexpr, LARGEST: tl.constexpr,
                  SUBNORMAL_MAGIC: tl.constexpr):
    x = tl.minimum(tl.maximum(x, -LARGEST), LARGEST)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # normal: drop 23 - MANTISSA mantissa bits, rounding half to even, then rebias the exponent
    drop: tl.constexpr = 23 - MANTISSA
    rounded = (magnitude + ((1 << (drop - 1)) - 1) + ((magnitude >> drop) & 1)) >> drop
    normal = rounded - ((127 - BIAS) << MANTISSA)
    # below the smallest normal (2**(1 - BIAS)): 2**k + |x| keeps |x| in the fp8 steps that the
    # sum's last mantissa bits count, rounded by the adder; the sum's bits minus 2**k's are the code
    magic = tl.full(x.shape, SUBNORMAL_MAGIC, tl.float32)
    summed = magnitude.to(tl.float32, bitcast=True) + magic
    subnormal = summed.to(tl.uint32, bitcast=True) - magic.to(tl.uint32, bitcast=True)
    code = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    return (code | sign).to(tl.uint8)
