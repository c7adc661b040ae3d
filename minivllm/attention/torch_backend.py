"""The torch reference backend: store K/V through the slot mapping, attend through the block table.

Plain torch, written for clarity, runs anywhere: the oracle the CPU's C++ kernel (cpu_attention.py)
and the Triton one (triton_backend.py) are tested against. An fp8 cache (kv_cache_dtype) is
quantized as it is stored and upcast, times its scale, as it is read (`read_kv`).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata
from minivllm.core.math_utils import cdiv
from minivllm.quantization.kv_cache import as_bytes, dequantize, quantize


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each new token's K and V into its slot; caches are [blocks, block_size, kv_heads, dim].
    An fp8 cache gets K / k_scale and V / v_scale, written as bytes (no fp8 index_copy_ on CPU)."""
    if (slot_mapping < 0).any():  # padded rows (CUDA-graph batches) store nothing
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    as_bytes(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, as_bytes(key))
    as_bytes(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, as_bytes(value))


def read_kv(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
            scale: float) -> torch.Tensor:
    """The listed blocks copied out of the cache, in order, in `dtype` (an fp8 cache's elements
    upcast times their scale): [len(block_ids) * block_size, heads, dim]. index_select on a flat
    view copies whole blocks, about twice as fast on CPU as fancy indexing."""
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.flatten().long())
    return dequantize(flat.view(-1, *cache.shape[2:]), scale, dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, max_batched_query: int = 8,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each request's new queries (q [T, heads, dim]) over its whole context,
    or, with a `sliding_window` w, over the w latest keys up to and including its own. Requests
    with a few new tokens (decodes, draft verification) are attended together, one batched call per
    query length; longer ones (prompts and their chunks) one request at a time."""
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]  # from the host copy: no device sync
    short: dict[int, list[int]] = {}
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len <= max_batched_query:
            short.setdefault(q_len, []).append(b)
            continue
        qb = q[starts[b] : starts[b] + q_len].transpose(0, 1)  # [heads, q_len, dim]
        blocks = meta.block_tables[b, : cdiv(seq_len, k_cache.shape[1])]  # the context's blocks
        kb = read_kv(k_cache, blocks, q.dtype, k_scale)[:seq_len].transpose(0, 1)
        vb = read_kv(v_cache, blocks, q.dtype, v_scale)[:seq_len].transpose(0, 1)
        # query i sits at position seq_len - q_len + i and sees keys up to there
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = visible(torch.arange(seq_len, device=q.device)[None, :], q_pos[:, None],
                       sliding_window)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                            enable_gqa=True)
        out[starts[b] : starts[b] + q_len] = ob.transpose(0, 1)
    for q_len, reqs in short.items():
        rows = torch.tensor([starts[b] + i for b in reqs for i in range(q_len)], device=q.device)
        batch = q[rows].view(len(reqs), q_len, *q.shape[1:])
        out[rows] = attend_batched(batch, k_cache, v_cache, meta, reqs, scale, k_scale, v_scale,
                                   sliding_window).flatten(0, 1)
    return out


def visible(key_pos: torch.Tensor, query_pos: torch.Tensor, sliding_window: int | None):
    """Which keys a query sees: those at or before it, and with a window w only the w latest
    (key > query - w, as transformers masks them). Broadcasts over the shapes given."""
    seen = key_pos <= query_pos
    return seen if sliding_window is None else seen & (key_pos > query_pos - sliding_window)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
    """All requests decode one token. q: [B, heads, dim]."""
    return attend_batched(q[:, None], k_cache, v_cache, meta, list(range(meta.num_seqs)), scale,
                          k_scale, v_scale, sliding_window)[:, 0]


def attend_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, reqs: list[int], scale: float, k_scale: float = 1.0,
                   v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
    """Requests `reqs`, each with the same number m of new queries: q [B, m, heads, dim] -> same
    shape. The grouping, block ids and masks depend only on the step, so the first layer builds them
    and the others reuse them (kept on the step's metadata)."""
    m, group = q.shape[1], q.shape[2] // k_cache.shape[2]
    key = (m, group, tuple(reqs), sliding_window)  # layers of one window share a plan
    if key not in meta.group_plans:
        meta.group_plans[key] = _plan_groups(meta, reqs, m, group, k_cache.shape[1],
                                             sliding_window)
    plan = meta.group_plans[key]
    if plan[0][0] is None:  # one group, in batch order: no rows to pick or scatter
        return _attend_group(q, k_cache, v_cache, plan[0][1], plan[0][2], scale, k_scale, v_scale)
    out = torch.empty_like(q)
    for rows, block_ids, mask in plan:
        out[rows] = _attend_group(q[rows], k_cache, v_cache, block_ids, mask, scale, k_scale,
                                  v_scale)
    return out


def _plan_groups(meta: AttentionMetadata, reqs: list[int], m: int, group: int, block_size: int,
                 sliding_window: int | None = None, num_groups: int = 4,
                 min_group: int = 8) -> list[tuple]:
    """Cut the requests into up to `num_groups` groups of similar context length: (rows, block ids,
    mask) each. One call would copy every context padded to the longest; sorting by length and
    attending in groups lets short contexts skip most of that padding (about 15% off a whole CPU
    benchmark run, where this copy is the largest cost). A few requests (under 2 * `min_group`) stay
    one group in batch order (rows None)."""
    dev = meta.seq_lens.device
    if len(reqs) < 2 * min_group:
        num_groups = 1
    by_length = list(range(len(reqs)))
    if num_groups > 1:
        by_length.sort(key=lambda i: meta.seq_lens_cpu[reqs[i]])
    size, plan = cdiv(len(by_length), num_groups), []
    for start in range(0, len(by_length), size):
        rows = by_length[start : start + size]
        batch = torch.tensor([reqs[i] for i in rows], device=dev)
        width = cdiv(max(meta.seq_lens_cpu[reqs[i]] for i in rows), block_size)  # longest context
        block_ids = meta.block_tables[batch, :width].long()
        # query i of a request sits at position seq_len - m + i and sees the keys up to there
        last_visible = meta.seq_lens[batch][:, None] - m + torch.arange(m, device=dev)  # [B, m]
        mask = visible(torch.arange(width * block_size, device=dev), last_visible[..., None],
                       sliding_window)
        # every query head of a kv head's group shares its query's mask row (m = 1: one, broadcast)
        if m > 1:
            mask = mask[:, None].expand(-1, group, -1, -1).reshape(len(rows), group * m, -1)
        plan.append((torch.tensor(rows, device=dev) if num_groups > 1 else None, block_ids,
                     mask[:, None]))
    return plan


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_ids: torch.Tensor, mask: torch.Tensor, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """The query heads that share a KV head (GQA) stand in for extra query positions: q is viewed as
    [B, kv_heads, heads_per_kv * m, dim], so K and V are never copied per query head."""
    num_seqs, m, num_heads, head_dim = q.shape
    num_kv_heads, group = k_cache.shape[2], num_heads // k_cache.shape[2]
    k = read_kv(k_cache, block_ids, q.dtype, k_scale).view(num_seqs, -1, num_kv_heads, head_dim)
    v = read_kv(v_cache, block_ids, q.dtype, v_scale).view(num_seqs, -1, num_kv_heads, head_dim)
    qg = q.view(num_seqs, m, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    out = F.scaled_dot_product_attention(qg.reshape(num_seqs, num_kv_heads, group * m, head_dim),
                                         k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, m, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(q.shape)


class TorchAttentionBackend:
    """The reference: store through the slot mapping, gather through the block table, SDPA."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.is_decode_only:
            return paged_decode_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                    sliding_window)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, k_scale=k_scale,
                                   v_scale=v_scale, sliding_window=sliding_window)
