"""Mixture-of-experts as grouped GEMMs: one launch multiplies every expert's block of sorted rows.

The reference (minivllm/model/moe.py) sorts (token, slot) pairs by expert and loops over experts.
Here one program computes a [BLOCK_M, BLOCK_N] tile of one expert's block: a tile table says which
expert each row tile belongs to and where it starts, so tiles never straddle two experts and empty
experts cost nothing. The table is built on the device with a length fixed by the batch (the most
tiles any routing could need), and programs past the routing's last tile return at once: nothing
waits on the host, so a decode step with experts can be recorded as a CUDA graph. The first GEMM
gathers its rows from the hidden states through the sorted token order (no permuted copy of the
activations); the second multiplies by the router weight in the epilogue, so combining is a plain
scatter-add of the sorted rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.activation import silu_and_mul
from minivllm.kernels.paged_decode import device_arch, small_tiles


@triton.jit
def _grouped_gemm_kernel(a_ptr, row_index_ptr, w_ptr, scale_ptr, row_weight_ptr, out_ptr,
                         tile_expert_ptr, tile_start_ptr, offsets_ptr, N, K, stride_am, stride_we,
                         stride_wn, stride_se, stride_om, GATHER: tl.constexpr,
                         WEIGHTED: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    start, end = tl.load(tile_start_ptr + tile), tl.load(offsets_ptr + expert + 1)
    if start >= end:  # past the last tile this routing needs
        return
    rows = start + tl.arange(0, BLOCK_M)
    m_mask = rows < end  # the expert's block ends here
    a_rows = tl.load(row_index_ptr + rows, mask=m_mask, other=0) if GATHER else rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_base + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if SCALED:  # int8 experts: every value is exact in the activations' dtype
            w = w.to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if SCALED:  # one scale per output row of this expert, applied once after the sum
        scale_row = scale_ptr + expert.to(tl.int64) * stride_se
        acc *= tl.load(scale_row + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc *= tl.load(row_weight_ptr + rows, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fused_moe_config(num_rows: int, dtype: torch.dtype, arch: int | None = None,
                     scaled: bool = False) -> dict:
    """Constexprs and launch options, also compiled by tests/test_aot_compile.py: row tiles no
    taller than needed (decode gives each expert a handful of rows), 32 wide where 64 spill. Int8
    weights (`scaled`) are converted in registers, and int8 to bf16 goes through fp32 on sm_80:
    64-wide tiles spilled there (16 to 32 bytes, whatever the K depth or stages), so bf16 int8
    experts take 32-wide ones everywhere."""
    small = small_tiles(arch, dtype) or (scaled and dtype == torch.bfloat16)
    tile = 32 if small else 64
    return dict(BLOCK_M=min(tile, max(16, triton.next_power_of_2(num_rows))), BLOCK_N=tile,
                BLOCK_K=tile, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                num_warps=4, num_stages=2 if small else 3)


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most row tiles any routing of `num_rows` rows can need: each expert's last is partial."""
    return min(num_rows, triton.cdiv(num_rows, block_m) + num_experts - 1)


def tile_table(offsets: torch.Tensor, block_m: int,
               num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `num_tiles` row tiles: its expert and its first sorted row, ceil(count /
    block_m) tiles per expert; the tiles past the last start at the end of the rows (no work)."""
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    tile = torch.arange(num_tiles, device=offsets.device)
    tile_expert = torch.searchsorted(ends, tile, right=True).clamp_(max=len(counts) - 1)
    start = offsets[tile_expert] + (tile - ends[tile_expert] + tiles[tile_expert]) * block_m
    return tile_expert, torch.where(tile < ends[-1], start, offsets[-1])


def _grouped_gemm(a: torch.Tensor, row_index: torch.Tensor | None, w: torch.Tensor,
                  scale: torch.Tensor | None, row_weight: torch.Tensor | None,
                  offsets: torch.Tensor, config: dict, tiles: tuple[torch.Tensor, torch.Tensor],
                  num_rows: int) -> torch.Tensor:
    n = w.shape[1]
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (len(tiles[0]), triton.cdiv(n, config["BLOCK_N"]))
    scale = None if scale is None else scale.contiguous()
    _grouped_gemm_kernel[grid](a, row_index if row_index is not None else offsets, w,
                               scale if scale is not None else a,
                               row_weight if row_weight is not None else a, out, tiles[0], tiles[1],
                               offsets, n, w.shape[2], a.stride(0), w.stride(0), w.stride(1),
                               scale.stride(0) if scale is not None else 0, out.stride(0),
                               GATHER=row_index is not None, WEIGHTED=row_weight is not None,
                               SCALED=scale is not None, **config)
    return out


def fused_moe_experts(hidden: torch.Tensor, weights: torch.Tensor, order,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      gate_up_scale: torch.Tensor | None = None,
                      down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' part of a MoE layer, given the routing sorted by expert (`order`: model/moe.py's
    ExpertOrder, same signature as its `grouped_experts`): gate_up GEMM on gathered rows,
    silu(gate) * up, weighted down GEMM, scatter-add. Int8 experts (with their per-row scales) are
    read as int8 bytes and converted in the kernel."""
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    out = torch.zeros_like(hidden)
    if hidden.shape[0] == 0:
        return out
    pair_order, offsets = order.pair_order, order.offsets
    token_of_row = pair_order // order.top_k
    rows = hidden.shape[0] * order.top_k
    config = fused_moe_config(rows, hidden.dtype, device_arch(hidden.device),
                              scaled=gate_up_scale is not None)
    num_experts = gate_up_proj.shape[0]
    tiles = tile_table(offsets, config["BLOCK_M"], max_tiles(rows, num_experts, config["BLOCK_M"]))
    gate_up = _grouped_gemm(hidden, token_of_row, gate_up_proj.contiguous(), gate_up_scale, None,
                            offsets, config, tiles, rows)
    row_weight = weights.reshape(-1)[pair_order].float().contiguous()
    down = _grouped_gemm(silu_and_mul(gate_up), None, down_proj.contiguous(), down_scale,
                         row_weight, offsets, config, tiles, rows)
    return out.index_add_(0, token_of_row, down)
