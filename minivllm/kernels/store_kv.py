"""store_kv: copy each new token's K and V into its slot of the paged cache.

The torch reference does this with index_copy_; here one Triton program moves one token (all its kv
heads) so the write is a single coalesced pass, and padding rows (slot -1) cost one load and an
early exit. An fp8 cache (kv_cache_dtype) is written as bytes: K / k_scale and V / v_scale, rounded
to fp8 in the kernel (fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8 import float_to_fp8, kv_format
from minivllm.quantization.kv_cache import as_bytes


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale, v_scale,  # an fp8 cache stores K / k_scale, V / v_scale (ignored by a float cache)
    stride_kt, stride_kh, stride_vt, stride_vh,  # new K/V: [T, kv_heads, head_dim], last stride 1
    stride_cb, stride_cs, stride_ch,  # cache: [num_blocks, block_size, kv_heads, head_dim], ditto
    num_kv_heads, head_dim,
    KV_BLOCK_SIZE: tl.constexpr,  # tokens per cache block (constexpr: // and % become shifts)
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # kv_heads and head_dim padded to powers of two
    KV_FP8: tl.constexpr = 0,  # 0: the cache has the model's dtype; 1: fp8 e4m3, 2: e5m2 (bytes)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)  # block_id * block_size + offset
    if slot < 0:  # a padding row: nothing to store
        return
    block, offset = slot // KV_BLOCK_SIZE, slot % KV_BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)  # padding lanes: none

    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + src, mask=mask)

    if KV_FP8 != 0:
        k = float_to_fp8(k.to(tl.float32) / k_scale, KV_FP8)
        v = float_to_fp8(v.to(tl.float32) / v_scale, KV_FP8)
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_config(num_kv_heads: int, head_dim: int, block_size: int, kv_fp8: int = 0) -> dict:
    """Constexprs, shared with the ahead-of-time compile test (tests/test_aot_compile.py)."""
    return dict(KV_BLOCK_SIZE=block_size, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=kv_fp8)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, kv_heads, head_dim] into caches [num_blocks, block_size, kv_heads, D] at
    slot_mapping [T] (int64; -1: a padding row, skipped). An fp8 cache gets K/k_scale, V/v_scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "cache rows must be contiguous"
    # rows are addressed by stride, but a row's head_dim elements must be adjacent
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    fmt = kv_format(k_cache.dtype)
    _store_kv_kernel[(num_tokens,)](
        key, value, as_bytes(k_cache), as_bytes(v_cache), slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, **store_kv_config(num_kv_heads, head_dim, k_cache.shape[1], fmt),
    )
