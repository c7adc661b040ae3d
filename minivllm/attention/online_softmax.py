"""Decode attention one block at a time with an online softmax: the Triton decode kernel, in torch.

A decoding query attends over its whole context, which lies in blocks scattered over the cache.
Instead of gathering the context and taking one softmax over it, walk the block table and keep three
running values per head: the largest score so far `m`, the sum of exp(score - m) `l`, and the sum of
exp(score - m) * value `acc`, rescaled by exp(m_old - m_new) whenever a block raises the maximum. At
the end acc / l equals softmax(q K) V exactly, and no row of scores longer than one block ever
exists: FlashAttention's trick, and what each program of kernels/paged_decode.py does. The engine
runs this path only when a learner plugs in their own update (EngineHooks.online_softmax_update,
chapter 02); its default decode path is torch_backend's batched SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend, store_kv
from minivllm.core.math_utils import cdiv
from minivllm.quantization.kv_cache import dequantize

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def online_softmax_update(m: torch.Tensor, l: torch.Tensor,  # noqa: E741
                          acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> State:
    """Fold one block into the running state. m, l: [H]; acc: [H, D]; scores: [H, n] (already
    scaled); v: [H, n, D]. Starts from m = -inf, l = 0, acc = 0."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    correction = torch.exp(m - m_new)  # how much the old sums shrink (0 at the start)
    p = torch.exp(scores - m_new[:, None])
    acc = acc * correction[:, None] + torch.einsum("hn,hnd->hd", p, v)
    return m_new, l * correction + p.sum(dim=-1), acc


def blockwise_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float,
                     update: Callable[..., State] = online_softmax_update, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q [B, heads, dim] -> [B, heads, dim]: each request's context read block by block through its
    table (an fp8 cache's blocks upcast times their scales)."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]  # query heads per KV head (GQA)
    tables = meta.block_tables.tolist()
    out = torch.empty_like(q)
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        qb = q[b].float()
        m = torch.full((num_heads,), float("-inf"), device=q.device)
        l = torch.zeros(num_heads, device=q.device)  # noqa: E741
        acc = torch.zeros(num_heads, q.shape[2], device=q.device)
        for i in range(cdiv(seq_len, block_size)):
            n = min(block_size, seq_len - i * block_size)  # the last block may be partly filled
            k = dequantize(k_cache[tables[b][i], :n], k_scale, torch.float32).float()
            v = dequantize(v_cache[tables[b][i], :n], v_scale, torch.float32).float()
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            m, l, acc = update(m, l, acc, torch.einsum("hd,hnd->hn", qb, k) * scale, v)  # noqa: E741
        out[b] = (acc / l[:, None]).to(q.dtype)
    return out


class OnlineSoftmaxBackend(TorchAttentionBackend):
    """The torch reference, with decode steps attended block by block through `update`."""

    name = "torch-online-softmax"

    def __init__(self, update: Callable[..., State] = online_softmax_update) -> None:
        self.update = update

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
        if not meta.is_decode_only or sliding_window is not None:  # the lesson is full attention
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                   sliding_window)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return blockwise_decode(q, k_cache, v_cache, meta, scale, self.update, k_scale, v_scale)
