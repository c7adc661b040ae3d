"""How big a KV block is, and how many fit in a memory budget: the arithmetic of `num_kv_blocks`.

A block id spans every layer: block b is one slot range of `block_size` tokens in each layer's K and
V tensors. So one block costs 2 (K and V) x layers x block_size x kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

from minivllm.core.math_utils import cdiv

# Without a GPU there is no memory to profile; this is the KV budget used on CPU unless
# `kv_cache_memory_bytes` says otherwise (vLLM's CPU backend has a similar fixed knob).
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return budget_bytes // bytes_per_block


def gpu_kv_budget(total_bytes: int, gpu_memory_utilization: float, peak_used_bytes: int) -> int:
    """What is left for KV blocks: our GPU share less weights and the profiled activation peak."""
    return int(total_bytes * gpu_memory_utilization) - peak_used_bytes


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks the running sequences could ever hold at once: max_num_seqs full-length ones.
    The engine takes no more than this from a memory budget. Extra blocks could only keep more
    prefixes cached; on a GPU they would also take memory that another engine in the same notebook
    needs (a tiny model would otherwise claim 90% of the card for KV blocks it can never fill)."""
    return max_num_seqs * cdiv(max_model_len, block_size)
