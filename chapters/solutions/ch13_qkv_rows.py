"""Reference solution, chapter 13: the fused q/k/v weight's rows one tensor-parallel rank holds."""


def my_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, rank: int) -> list[int]:
    q_heads = num_heads // tp_size  # every rank gets its own run of query heads
    if num_kv_heads >= tp_size:  # and its own run of KV heads
        kv_heads, first_kv = num_kv_heads // tp_size, rank * (num_kv_heads // tp_size)
    else:  # fewer KV heads than ranks: tp_size / num_kv_heads neighbouring ranks share one
        kv_heads, first_kv = 1, rank // (tp_size // num_kv_heads)
    q = range(rank * q_heads * head_dim, (rank + 1) * q_heads * head_dim)
    k_start = (num_heads + first_kv) * head_dim
    v_start = (num_heads + num_kv_heads + first_kv) * head_dim
    k = range(k_start, k_start + kv_heads * head_dim)
    v = range(v_start, v_start + kv_heads * head_dim)
    return [*q, *k, *v]
