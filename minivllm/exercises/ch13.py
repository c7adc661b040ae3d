"""Chapter 13 exercise: which rows of the fused q/k/v weight one tensor-parallel rank holds.

The learner's `my_qkv_rows(num_heads, num_kv_heads, head_dim, tp_size, rank)` returns row indices of
the fused weight [(num_heads + 2 * num_kv_heads) * head_dim, hidden]. The engine answers the same
question with its own layer: a `ColumnLinear` built for that rank loads a weight whose row i holds
the number i, and keeps the rows its `weight_loader` chooses. The checker compares the two on a
known case, on every shape that splits up to 8 ranks (KV heads replicated when fewer than the
ranks), then on the embedded model's real weights as the loader shards them for 2 ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.config import DEFAULT_MODEL
from minivllm.distributed.parallel import TensorParallel, kv_head_replicas
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.model import read_model_config
from minivllm.model.linear import ColumnLinear
from minivllm.model.llama import READABLE
from minivllm.model.loader import load_model
from minivllm.quantization.unquantized import UnquantizedLinearMethod, plain_weight


def engine_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int,
                    rank: int) -> list[int]:
    """The rows the engine's q/k/v layer keeps on `rank`: load row numbers as weights, read back."""
    tp = TensorParallel(rank, tp_size)  # no process group: loading needs only the rank and the size
    copies = kv_head_replicas(num_kv_heads, tp_size)
    layer = ColumnLinear(1, [num_heads * head_dim] + [num_kv_heads * head_dim] * 2, False,
                         method=UnquantizedLinearMethod(), tp=tp, replicas=[1, copies, copies])
    start = 0
    for shard, heads in enumerate((num_heads, num_kv_heads, num_kv_heads)):
        rows = torch.arange(start, start + heads * head_dim, dtype=torch.float32)[:, None]
        layer.weight_loader("weight", rows, shard)
        start += heads * head_dim
    return [int(r) for r in layer.weight[:, 0].tolist()]


def splitting_shapes(max_ranks: int = 8) -> list[tuple[int, int, int, int]]:
    """(num_heads, num_kv_heads, head_dim, tp_size) the engine accepts: heads divide, KV heads
    divide or are divided by the ranks (tensor_parallel_size does not have to divide head_dim)."""
    return [(num_heads, num_kv_heads, 3, tp_size) for tp_size in range(1, max_ranks + 1)
            for num_heads in (tp_size, 2 * tp_size, 4 * tp_size)
            for num_kv_heads in range(1, num_heads + 1)
            if num_heads % num_kv_heads == 0
            and (num_kv_heads % tp_size == 0 or tp_size % num_kv_heads == 0)]


def _rows(fn: Callable, *shape: int) -> list[int]:
    rows = fn(*shape)
    try:
        return [int(r) for r in rows]
    except TypeError as e:
        raise ExerciseFailure(f"my_qkv_rows must return a list of row indices; it returned "
                              f"{type(rows).__name__}.") from e


def _compare(fn: Callable, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int,
             rank: int) -> None:
    yours = _rows(fn, num_heads, num_kv_heads, head_dim, tp_size, rank)
    want = engine_qkv_rows(num_heads, num_kv_heads, head_dim, tp_size, rank)
    if yours == want:
        return
    case = (f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
            f"tp_size={tp_size}, rank={rank}")
    q = num_heads // tp_size * head_dim
    if len(yours) != len(want):
        raise ExerciseFailure(f"for {case} rank {rank} holds {len(want)} rows ({q} of q, "
                              f"{(len(want) - q) // 2} each of k and v); yours has {len(yours)}.")
    k_end = (len(want) + q) // 2
    part = next(name for name, lo, hi in (("q", 0, q), ("k", q, k_end), ("v", k_end, len(want)))
                if yours[lo:hi] != want[lo:hi])
    hint = (" Fewer KV heads than ranks: each KV head is replicated on tp_size / num_kv_heads "
            "ranks, so neighbouring ranks hold the same k and v rows."
            if num_kv_heads < tp_size and part != "q" else "")
    raise ExerciseFailure(f"for {case} your {part} rows differ from the engine's: yours {yours}, "
                          f"the engine's {want}.{hint}")


def check_qkv_rows(rows_fn: Callable, max_ranks: int = 8) -> Report:
    """Grade `my_qkv_rows(num_heads, num_kv_heads, head_dim, tp_size, rank) -> list[int]`."""

    def known_answer():
        # q heads 2, 3 -> rows 4..7; KV head 1 -> rows 10, 11 and 14, 15
        _compare(rows_fn, 4, 2, 2, 2, 1)

    def every_shape():
        for num_heads, num_kv_heads, head_dim, tp_size in splitting_shapes(max_ranks):
            for rank in range(tp_size):
                _compare(rows_fn, num_heads, num_kv_heads, head_dim, tp_size, rank)

    def embedded_model():
        mc = read_model_config(DEFAULT_MODEL)

        def qkv(tp: TensorParallel) -> torch.Tensor:
            model = load_model(DEFAULT_MODEL, mc, READABLE, torch.float32, "cpu", tp)
            return plain_weight(model.model.layers[0].self_attn.qkv_proj)

        full = qkv(TensorParallel())
        for rank in range(2):
            rows = _rows(rows_fn, mc.num_heads, mc.num_kv_heads, mc.head_dim, 2, rank)
            if not torch.equal(full[rows], qkv(TensorParallel(rank, 2))):
                raise ExerciseFailure(f"the embedded model's layer 0 q/k/v rows you chose for rank "
                                      f"{rank} of 2 are not the weights the engine's loader gives "
                                      f"that rank.")

    return run_checks("ch13 qkv shard rows", [
        ("rank 1 of 2 on a model with 4 heads and 2 KV heads", known_answer),
        ("every shape that splits, up to 8 ranks, KV heads replicated when fewer than the ranks",
         every_shape),
        ("the embedded model's real q/k/v weights, as the engine loads them on each of 2 ranks",
         embedded_model)])
