"""Paged prefill attention: many new queries per request, causal, over a partly cached context.

FlashAttention over a paged cache. A program owns one request's kv head and a tile of BLOCK_M rows:
consecutive new queries, each repeated for every query head sharing the kv head (GQA), so each K/V
tile is loaded once for the group. It walks the keys in tiles of BLOCK_N positions through the block
table (the new tokens' K/V are stored first, so cached prefix and new tokens read alike). Online
softmax: one pass over K/V and no [q, k] matrix in memory.

Query i of a request with q_len new tokens and seq_len context tokens sits at position
seq_len - q_len + i and sees keys 0..that position. That one rule covers a fresh prompt (q_len ==
seq_len), a chunked-prefill chunk or a prompt after a prefix-cache hit (q_len < seq_len), a decode
row in a mixed batch (q_len == 1) and speculative draft tokens. An fp8 cache is decoded in
registers, its scales folded into the score scale and the output, as in decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8 import dequant_factor, fp8_to_half, kv_format
from minivllm.kernels.paged_decode import device_arch, small_tiles
from minivllm.quantization.kv_cache import as_bytes


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale,
    k_dequant, v_dequant,  # what a decoded fp8 element is multiplied by (1.0 if float): fp8.py
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,  # cache strides: block, slot in block, kv head (head_dim: 1)
    stride_bt,
    stride_ot, stride_oh,
    head_dim,
    window,  # sliding window: each query sees its `window` latest keys (<= 0: all before it)
    QUERY_GROUP: tl.constexpr,  # query heads per kv head
    QUERIES_PER_TILE: tl.constexpr,  # BLOCK_M // QUERY_GROUP: each query takes QUERY_GROUP rows
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: (query, head of the group) pairs
    BLOCK_N: tl.constexpr,  # key positions per tile
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two (>= 16)
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = 0,  # 0: the cache has q's dtype; 1: fp8 e4m3, 2: fp8 e5m2 (as bytes)
):
    b = tl.program_id(0)
    m_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if m_tile * QUERIES_PER_TILE >= q_len:  # the grid is sized for the longest request
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - q_len  # context already in the cache before this step

    rows = tl.arange(0, BLOCK_M)
    offs_m = m_tile * QUERIES_PER_TILE + rows // QUERY_GROUP  # each row's query in the request
    heads = kv_head * QUERY_GROUP + rows % QUERY_GROUP  # and its query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = (rows < QUERIES_PER_TILE * QUERY_GROUP) & (offs_m < q_len)
    d_mask = offs_d < head_dim
    q_pos = prefix_len + offs_m  # each row's position in the sequence

    tokens = (q_start + offs_m).to(tl.int64)
    q_rows = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D]
    qk_scale = scale * k_dequant * 1.4426950408889634  # softmax via exp2: fold in log2(e)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causality: no query in this tile sees past the last one's position, so stop the walk there.
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * QUERIES_PER_TILE)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    # with a window, the key tiles before the tile's first query's window are skipped
    lowest = tl.where(window > 0,
                      tl.maximum(prefix_len + m_tile * QUERIES_PER_TILE - window + 1, 0), 0)
    for start in range(lowest // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < kv_end
        block = tl.load(table + pos // KV_BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_rows = block * stride_cb + (pos % KV_BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]  # K and V tiles: [N, D]
        k = tl.load(k_cache_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8 != 0:
            k = fp8_to_half(k, KV_FP8).to(q.dtype)
            v = fp8_to_half(v, KV_FP8).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, prefix included
        visible &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)  # and in the window
        s = tl.where(visible, s, float("-inf"))
        # Once a row has seen a key m_i is finite: a later tile it cannot see at all gives alpha = 1
        # and p = 0 instead of NaN. Before (a window starting past this tile) its max stays -inf,
        # taken as 0 here so that alpha and p are 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # padding rows (past q_len, or past the last whole query) are not stored
    # a row past its request's queries may see no key at all under a window (l_i 0): not stored
    out = acc * v_dequant / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_launch_config(head_dim: int, group: int, block_size: int, max_query_len: int,
                          dtype: torch.dtype, arch: int | None = None, block_m: int | None = None,
                          block_n: int | None = None, kv_fp8: int = 0) -> dict:
    """The prefill kernel's constexprs and launch options, shared by the launcher and the
    ahead-of-time compile test (tests/test_aot_compile.py) so that both see the same variants.

    block_m None: tiles no taller than the batch needs (tl.dot wants >= 16 rows). Where 64-wide
    tiles spill (sm_75, fp32: `small_tiles`), tiles are at most 32 rows by 16 key positions (32
    still spills at head_dim 128). arch: compute capability, None off CUDA.
    """
    small = small_tiles(arch, dtype)
    if block_m is None:
        block_m = max(min(32 if small else 64,
                          max(16, triton.next_power_of_2(max_query_len * group))),
                      triton.next_power_of_2(group))
    if block_n is None:  # 32 on sm_80 from head_dim 64, and for an fp8 cache: 64 spills there
        narrow = arch is not None and ((arch < 90 and head_dim >= 64) or kv_fp8)
        block_n = 16 if small else 32 if narrow else 64
    for size in (block_m, block_n):
        assert size >= 16 and size & (size - 1) == 0, "tl.dot needs powers of two >= 16"
    assert block_m >= group, "a tile must hold every query head of at least one query"
    return dict(QUERY_GROUP=group, QUERIES_PER_TILE=block_m // group, KV_BLOCK_SIZE=block_size,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
                # fp8: converted in registers, no prefetch (decode_launch_config)
                num_warps=4, num_stages=1 if kv_fp8 else 2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, max_query_len: int,
                            block_m: int | None = None, block_n: int | None = None,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged context (with a
    `sliding_window` w, each query's w latest keys): q [T, H, D] -> same.

    caches: [num_blocks, block_size, kv_heads, D]; block_tables [B, max_blocks] int32;
    query_start_loc [B + 1] int32 (where each request's queries start in q); seq_lens [B] int32
    (context length with the new tokens, whose K/V must already be cached); max_query_len (host
    int) sizes the grid. An fp8 cache holds K / k_scale and V / v_scale."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    fmt = kv_format(k_cache.dtype)
    config = prefill_launch_config(head_dim, num_heads // num_kv_heads, k_cache.shape[1],
                                   max_query_len, q.dtype, device_arch(q.device), block_m, block_n,
                                   fmt)
    grid = (num_seqs, triton.cdiv(max_query_len, config["QUERIES_PER_TILE"]), num_kv_heads)
    _paged_prefill_kernel[grid](
        q, as_bytes(k_cache), as_bytes(v_cache), block_tables, query_start_loc, seq_lens, out,
        scale, dequant_factor(fmt, k_scale), dequant_factor(fmt, v_scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), head_dim,
        -1 if sliding_window is None else sliding_window, **config,
    )
    return out
