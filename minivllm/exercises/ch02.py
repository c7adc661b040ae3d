"""Chapter 02 exercise: the online-softmax update of decode attention, one KV block at a time.

The checker folds random blocks through the learner's update and compares the result with softmax(q
K) V, then runs the engine with it (its torch reference then attends every decode step block by
block through the KV cache, attention/online_softmax.py) and compares the greedy tokens with
transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.exercises.common import check_greedy_matches_transformers
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks


def _fold(update: Callable, scores: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    heads, dim = v.shape[0], v.shape[2]
    m, acc = torch.full((heads,), float("-inf")), torch.zeros(heads, dim)
    l = torch.zeros(heads)  # noqa: E741
    for start in range(0, scores.shape[1], block):
        m, l, acc = update(m, l, acc, scores[:, start : start + block],  # noqa: E741
                           v[:, start : start + block])
    return acc / l[:, None]


def check_online_softmax_update(update: Callable) -> Report:
    """Grade `online_softmax_update(m [H], l [H], acc [H, D], scores [H, n], v [H, n, D])`, which
    returns the new (m, l, acc)."""
    gen = torch.Generator().manual_seed(0)  # the checker's own inputs, the same every run

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def one_block():
        scores, v = randn(2, 5), randn(2, 5, 3)
        got, want = _fold(update, scores, v, 5), scores.softmax(-1)[:, :, None].mul(v).sum(1)
        if not torch.allclose(got, want, atol=1e-5):
            g, w = ([round(x, 4) for x in t[0].tolist()] for t in (got, want))
            raise ExerciseFailure(f"one block of 5 scores, starting from m = -inf, l = 0, acc = 0: "
                                  f"acc / l is {g} for head 0, but softmax(scores) @ v is {w}.")

    def many_blocks():
        scores = torch.arange(12.0).repeat(2, 1) * torch.tensor([[0.5], [-0.5]]) + randn(2, 12)
        v = randn(2, 12, 4)
        want = scores.softmax(-1)[:, :, None].mul(v).sum(1)
        got = _fold(update, scores, v, 4)
        if not torch.allclose(got, want, atol=1e-5):
            err = (got - want).abs().max().item()
            raise ExerciseFailure(f"over 3 blocks of 4 scores whose maximum rises block after "
                                  f"block (head 0), acc / l is off softmax(scores) @ v by up to "
                                  f"{err:.3g}: when a block raises the running maximum, rescale "
                                  f"the old l and acc by exp(m_old - m_new).")

    def large_scores():
        scores, v = torch.tensor([[1000.0, 999.0, 998.0, 1001.0]]), randn(1, 4, 2)
        got = _fold(update, scores, v, 2)
        if not torch.isfinite(got).all():
            raise ExerciseFailure("scores near 1000 gave inf or NaN: exp(1000) overflows. "
                                  "Exponentiate score - m (the running maximum), never the raw "
                                  "score.")

    def engine_equality():
        check_greedy_matches_transformers(EngineHooks(online_softmax_update=update),
                                          "blocks of 4 tokens (every decode walks several blocks)",
                                          block_size=4, num_kv_blocks=64)

    return run_checks("ch02 online_softmax_update", [
        ("one block gives softmax(scores) @ v", one_block),
        ("several blocks, with the maximum rising, give the same", many_blocks),
        ("large scores do not overflow", large_scores),
        ("the engine decodes with it and matches transformers", engine_equality)])
