"""The torch reference backend: store K/V through the slot mapping, attend through the block table.

It is written for clarity, runs anywhere, and is the oracle the Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.attention.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V into its slot; caches are [num_blocks, block_size, kv_heads, dim]."""
    if (slot_mapping < 0).any():  # padded rows (CUDA-graph batches) store nothing
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks out of the cache, in order: [len(block_ids) * block_size, kv_heads, dim].

    index_select on a flat view copies whole contiguous blocks, about twice as fast on CPU as fancy indexing.
    """
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.flatten().long())
    return flat.view(-1, *cache.shape[2:])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's K (or V) for positions 0..seq_len-1, read block by block: [seq_len, kv_heads, dim]."""
    num_blocks = -(-seq_len // cache.shape[1])
    return gather_blocks(cache, block_table[:num_blocks])[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole cached context. q: [T, heads, dim]."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        qb = q[starts[b] : starts[b] + q_len].transpose(0, 1)  # [heads, q_len, dim]
        kb = gather_context(k_cache, meta.block_tables[b], seq_len).transpose(0, 1)
        vb = gather_context(v_cache, meta.block_tables[b], seq_len).transpose(0, 1)
        # query i sits at position seq_len - q_len + i and sees keys up to there
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[b] : starts[b] + q_len] = ob.transpose(0, 1)
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, num_groups: int = 4) -> torch.Tensor:
    """All requests decode one token: gather their contexts and attend in a few batched calls.

    One call would copy every context padded to the longest; sorting by length and attending in
    `num_groups` groups of similar length lets short contexts skip most of that padding (about 15% off a
    whole CPU benchmark run, where this copy is the largest cost).
    """
    out = torch.empty_like(q)
    by_length = sorted(range(meta.num_seqs), key=meta.seq_lens_cpu.__getitem__)
    size = -(-len(by_length) // num_groups)
    for start in range(0, len(by_length), size):
        group = by_length[start : start + size]
        rows = torch.tensor(group, device=q.device)
        out[rows] = _decode_group(q[rows], k_cache, v_cache, meta.block_tables[rows], meta.seq_lens[rows],
                                  meta.seq_lens_cpu[group[-1]], scale)
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """With one query per head, the query heads that share a KV head (GQA) can stand in for query positions:
    q becomes [B, kv_heads, heads_per_kv, dim], so K and V are never copied per query head."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    table = block_tables[:, : -(-max_seq_len // block_size)]
    k = gather_blocks(k_cache, table).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kv, ctx, d]
    v = gather_blocks(v_cache, table).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q.view(num_seqs, num_kv_heads, -1, head_dim), k, v,
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return paged_decode_ref(q, k_cache, v_cache, meta, scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
