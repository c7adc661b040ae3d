"""Chapter 12 exercise: int8 per-channel quantization of a weight matrix.

The checker tries a matrix with a known answer, then properties on random ones (the range is used in
full, the error is at most half a step, an all-zero row gets a positive scale and q = 0), then
loads the embedded model with `quantization="int8"` and the learner's function plugged in
(EngineHooks.int8_quantize): greedy tokens must equal those of the engine's own int8 quantizer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.exercises.common import generate
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks

KNOWN = [[0.5, -1.27, 0.0, 1.0], [2.0, 0.02, -0.5, 0.1]]


def _call(quantize_fn: Callable, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = quantize_fn(weight.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ExerciseFailure(f"my_quantize must return a pair (q, scale); it returned "
                              f"{type(out).__name__}.")
    q, scale = out
    n, k = weight.shape
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or tuple(q.shape) != (n, k):
        raise ExerciseFailure(f"q must be an int8 tensor shaped like the weight, ({n}, {k}); got "
                              f"{getattr(q, 'dtype', type(q).__name__)} "
                              f"{tuple(getattr(q, 'shape', ()))}.")
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (n,):
        raise ExerciseFailure(f"scale must be a tensor with one value per output channel (row): "
                              f"shape ({n},); got {tuple(getattr(scale, 'shape', ()))}.")
    return q, scale.float()


def _check_properties(quantize_fn: Callable) -> None:
    """Random rows: the full int8 range, at most half a step off, and a zero row gets a positive
    scale and q = 0 (without the guard its q comes from casting NaN, which only happens to be 0 on
    some machines: checking that `back` is finite alone would pass it)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 40, generator=gen) * torch.logspace(-3, 1, 16)[:, None]
    w[5] = 0.0  # a row of zeros: its scale must not make 0 / 0
    q, scale = _call(quantize_fn, w)
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        rows = [i for i, v in enumerate(scale.tolist()) if not 0 < v < float("inf")]
        got = [scale[i].item() for i in rows]
        raise ExerciseFailure(f"row(s) {rows} got scale {got}; every scale must be positive. Row 5 "
                              f"is all zeros, so max|w| / 127 = 0 and w / scale is 0 / 0 = NaN, "
                              f"and casting NaN to int8 is undefined (0 on some machines, anything "
                              f"on others): give such a row a tiny positive scale, e.g. "
                              f"clamp(min=1e-12).")
    if q[5].any():
        raise ExerciseFailure(f"row 5 is all zeros, so its q must be all zeros; yours holds "
                              f"{sorted(set(q[5].tolist()))}.")
    back = q.float() * scale[:, None]
    if not torch.isfinite(back).all():
        raise ExerciseFailure("an all-zero row came back as NaN or inf: with max|w| = 0 the "
                              "scale is 0 and w / scale is 0 / 0; give such a row a tiny "
                              "positive scale (or q = 0).")
    used = q.abs().amax(dim=1)
    if (used[torch.arange(16) != 5] != 127).any():
        raise ExerciseFailure(f"each row's largest |q| should be 127 (the full int8 range); "
                              f"yours are {used.tolist()}.")
    err = (back - w).abs() - scale[:, None] / 2
    if (err > 1e-6 * w.abs().amax(dim=1, keepdim=True) + 1e-12).any():
        row = int(err.amax(dim=1).argmax())
        raise ExerciseFailure(f"row {row} is off by more than half a step (scale / 2) somewhere: "
                              "round to the nearest integer rather than truncating.")


def check_int8_quantize(quantize_fn: Callable) -> Report:
    """Grade `my_quantize(weight [N, K] float32) -> (q [N, K] int8, scale [N])`, with
    W ~ q * scale[:, None]."""

    def known_answer():
        q, scale = _call(quantize_fn, torch.tensor(KNOWN))
        want_scale = torch.tensor([1.27 / 127, 2.0 / 127])
        if not torch.allclose(scale, want_scale, rtol=1e-4):
            raise ExerciseFailure(f"for rows {KNOWN} the scales should be max|w| / 127 per row = "
                                  f"{[round(s, 6) for s in want_scale.tolist()]}; yours are "
                                  f"{[round(s, 6) for s in scale.tolist()]}.")
        want_q = torch.round(torch.tensor(KNOWN) / want_scale[:, None]).to(torch.int8)
        if not torch.equal(q, want_q):
            raise ExerciseFailure(f"with those scales q should be round(w / scale) = "
                                  f"{want_q.tolist()}; yours is {q.tolist()}.")

    def engine_tokens():
        _, theirs, _ = generate(EngineHooks(), max_tokens=12, dtype="float32", quantization="int8")
        _, yours, _ = generate(EngineHooks(int8_quantize=quantize_fn), max_tokens=12,
                               dtype="float32", quantization="int8")
        for i, (a, b) in enumerate(zip(theirs, yours)):
            if a != b:
                j = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                raise ExerciseFailure(f"the embedded model quantized by your function writes token "
                                      f"{b[j]} at position {j} of request {i}; with the engine's "
                                      f"own int8 it writes {a[j]}.")

    return run_checks("ch12 int8 quantize", [
        ("scales and q are right on a matrix with a known answer", known_answer),
        ("every row uses the full range, within half a step, and zero rows stay finite",
         lambda: _check_properties(quantize_fn)),
        ("the embedded model, quantized by your function, writes the engine's int8 tokens",
         engine_tokens)])
