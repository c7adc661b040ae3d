"""Paged decode attention: one new query token per request, attending over its whole cached context.

Decode is memory bound: every step reads each request's entire K/V once and does little math with
it. So the kernel is organised around reading K/V as few times as possible and keeping the GPU busy:

* one program per (request, kv head) serves all the query heads that share that kv head (GQA), so
  each K/V tile is loaded once for the whole group instead of once per query head;
* the context is walked in tiles of BLOCK_N positions; each position's physical block comes from the
  block table, so tiles need not line up with cache blocks (any block_size, partial last blocks);
* online softmax (running max m_i, running sum l_i, unnormalised output acc): one pass over K/V;
* split-K ("flash-decoding"): with few requests, (request, kv head) pairs alone cannot fill the GPU,
  so each context is also cut into NUM_SPLITS slices processed by separate programs; each writes its
  partial (m_i, l_i, acc) and a small reduce kernel merges them.

An fp8 cache (kv_cache_dtype) is read as bytes and decoded in registers (fp8.py); its scales are
folded into the score scale (K) and into the output (V), so they cost nothing per element.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minivllm.kernels.fp8 import dequant_factor, fp8_to_half, kv_format
from minivllm.quantization.kv_cache import as_bytes

MIN_TOKENS_PER_SPLIT = 256  # below this a slice is too short to pay for its share of the reduce
MAX_SPLITS = 16


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr,  # [B, H, D] (used when NUM_SPLITS == 1)
    part_acc_ptr, part_m_ptr, part_l_ptr,  # split-K fp32: [B, H, NUM_SPLITS, D], [B, H, NUM_SPLITS]
    scale,
    k_dequant, v_dequant,  # what a decoded fp8 element is multiplied by (1.0 if float): fp8.py
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,  # cache strides: block, slot in block, kv head (head_dim: 1)
    stride_bt,
    stride_ob, stride_oh,
    head_dim,
    window,  # sliding window: the query sees its `window` latest keys (<= 0: the whole context)
    QUERY_GROUP: tl.constexpr,  # query heads per kv head
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # QUERY_GROUP padded (>= 16: tl.dot needs at least 16 rows)
    BLOCK_N: tl.constexpr,  # context positions per tile
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two (>= 16)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 exact on GPUs that would otherwise use tf32
    KV_FP8: tl.constexpr = 0,  # 0: the cache has q's dtype; 1: fp8 e4m3, 2: fp8 e5m2 (as bytes)
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    # This program's slice of the context, in whole tiles; with short contexts a slice may be empty.
    # a window's keys start at seq_len - window: the tiles before it are never read
    first_pos = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first_tile = first_pos // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * QUERY_GROUP + offs_g  # the query heads of this kv head's group
    g_mask = offs_g < QUERY_GROUP
    d_mask = offs_d < head_dim

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    # softmax via exp2 (the native instruction): fold in log2(e), and an fp8 cache's K scale
    qk_scale = scale * k_dequant * 1.4426950408889634

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # running sum of exp(score - m_i) * v
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n
        n_mask = (pos < seq_len) & (pos >= first_pos)  # the context's ends, the window's start
        # position -> physical block (block table) -> its row for this kv head
        block = tl.load(table + pos // KV_BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % KV_BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]  # K and V tiles: [N, D]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8 != 0:
            k = fp8_to_half(k, KV_FP8).to(q.dtype)
            v = fp8_to_half(v, KV_FP8).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one real position, so m_new is finite and nothing becomes NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    acc = acc * v_dequant
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Unnormalised fp32 partials; an empty slice writes m_i=-inf, l_i=0, acc=0 (weight 0 later)
        row = (b * tl.num_programs(1) * QUERY_GROUP + heads) * NUM_SPLITS + split  # [B, H, S] index
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def _split_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    stride_ob, stride_oh,
    num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the slices of one (request, query head): rescale each to the global max, normalise."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    m_s = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))  # one value per slice
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc_s = tl.load(part_acc_ptr + row[:, None] * head_dim + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    m_max = tl.max(m_s, axis=0)  # finite: the first slice is never empty
    # each slice's weight under the global max; empty slices: exp2(-inf) = 0
    w = tl.exp2(m_s - m_max)
    out = tl.sum(acc_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many slices to cut each context into so that the grid fills the GPU about twice over:
    none if (request, kv head) programs already fill it, and never slices shorter than
    MIN_TOKENS_PER_SPLIT tokens, nor more than MAX_SPLITS."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def decode_launch_config(head_dim: int, group: int, block_size: int, num_splits: int,
                         dtype: torch.dtype, arch: int | None = None, block_n: int | None = None,
                         num_warps: int = 4, num_stages: int | None = None,
                         kv_fp8: int = 0) -> dict:
    """The decode kernel's constexprs and launch options: one pure function, so that the launcher
    and the ahead-of-time compile test (tests/test_aot_compile.py) see the very same variants.

    arch: compute capability as an int (75 for a T4), None off CUDA. 64-position tiles need more
    than a thread's 255 registers and spill on sm_75 and in fp32 (bench/kernel_report.py): there
    the default tile is 32 positions. An fp8 cache (kv_fp8, fp8.py) is converted in registers, where
    the software pipeline (num_stages=2) would also keep the next tile's bytes: fp8 defaults to one
    stage (with two, 64-wide tiles spill on sm_80 and sm_90), and in fp32 to 16-position tiles (32
    still spills on sm_90). On a T4 in fp32, heads over 64 wide also take 16-position tiles: with
    the window's bounds in the loop, 32 spills there (bench/kernel_report.py --arch 75).
    """
    if block_n is None:
        wide_t4_head = arch is not None and arch < 80 and head_dim > 64
        narrow = dtype == torch.float32 and arch is not None and (kv_fp8 or wide_t4_head)
        block_n = 16 if narrow else 32 if small_tiles(arch, dtype) else 64
    if num_stages is None:
        num_stages = 1 if kv_fp8 else 2
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "tl.dot needs a power of two >= 16"
    return dict(QUERY_GROUP=group, KV_BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
                BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", KV_FP8=kv_fp8,
                num_warps=num_warps, num_stages=num_stages)


def small_tiles(arch: int | None, dtype: torch.dtype) -> bool:
    """On a GPU where 64-wide attention tiles spill: sm_75 (T4), or fp32 (twice the registers)."""
    return arch is not None and (arch < 80 or dtype == torch.float32)


def split_reduce_config(head_dim: int, num_splits: int) -> dict:
    """The split-K reduce kernel's constexprs (it runs only when num_splits > 1)."""
    return dict(NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)))


@functools.lru_cache
def device_arch(device: torch.device) -> int | None:
    """Compute capability as an int (75, 80, 90), None off CUDA: launch choices depend on it."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the CPU interpreter runs programs one by one: splitting only adds work


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query per request over its paged context (with a `sliding_window` w, its w
    latest keys): q [B, H, D] -> [B, H, D].

    caches: [num_blocks, block_size, kv_heads, D]; block_tables [B, max_blocks] int32; seq_lens [B]
    int32 (context length including the token being decoded). max_seq_len (a host int, so no device
    sync) drives the automatic split-K choice; num_splits forces it (1 = no split). block_n (None:
    `decode_launch_config`'s choice), num_warps and num_stages are the knobs that
    `bench/gpu_kernels.py --sweep` tunes. An fp8 cache holds K / k_scale and V / v_scale."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(q.device))
    fmt = kv_format(k_cache.dtype)
    config = decode_launch_config(head_dim, num_heads // num_kv_heads, k_cache.shape[1], num_splits,
                                  q.dtype, device_arch(q.device), block_n, num_warps, num_stages,
                                  fmt)
    if num_splits > 1:
        shape = (num_seqs, num_heads, num_splits)
        part_acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel, but every pointer argument needs a tensor
        part_acc = part_m = part_l = out
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, as_bytes(k_cache), as_bytes(v_cache), block_tables, seq_lens, out, part_acc, part_m,
        part_l, scale, dequant_factor(fmt, k_scale), dequant_factor(fmt, v_scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), head_dim,
        -1 if sliding_window is None else sliding_window, **config,
    )
    if num_splits > 1:
        _split_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), num_heads, head_dim,
            **split_reduce_config(head_dim, num_splits),
        )
    return out
