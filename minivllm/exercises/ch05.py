"""Chapter 05 exercise: top-p (nucleus) filtering.

The checker tries the filter on rows with a known answer, then draws many tokens through the
engine's real Sampler with it (a statistical test against the exact nucleus distribution), then runs
the engine with it on seeded sampling requests, whose tokens must equal those of the engine's own
filter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.exercises.common import generate
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks
from minivllm.sampling import Sampler, SamplingBatch
from minivllm.sampling_params import SamplingParams

# deliberately not sorted: the filter must put its answer back in vocab order
PROBS = [0.05, 0.5, 0.15, 0.3]


def _kept(top_p_fn: Callable, probs: list[float], p: float) -> list[int]:
    out = top_p_fn(torch.tensor([probs]).log(), torch.tensor([p]))
    if not isinstance(out, torch.Tensor) or out.shape != (1, len(probs)):
        raise ExerciseFailure(f"top_p must return the logits tensor, shape [rows, vocab] = (1, "
                              f"{len(probs)}); it returned {type(out).__name__} "
                              f"{getattr(out, 'shape', '')}.")
    return [i for i, x in enumerate(out[0].tolist()) if x != float("-inf")]


def _check_sampler_distribution(top_p_fn: Callable, draws: int) -> None:
    """Many draws through the real Sampler: the filter must give the nucleus its exact odds."""
    sampler = Sampler(seed=0, top_p_filter=top_p_fn)
    params = [SamplingParams(temperature=1.0, top_p=0.75)] * draws
    tokens = sampler(torch.tensor([PROBS]).log().expand(draws, -1).clone(),
                     SamplingBatch.build(params, [[]] * draws, "cpu")).tolist()
    freq = [tokens.count(t) / draws for t in range(len(PROBS))]
    want = [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]
    worst = max(abs(f - w) for f, w in zip(freq, want))
    if worst > 0.02:
        raise ExerciseFailure(f"{draws} draws through the engine's Sampler with top_p=0.75 "
                              f"gave token frequencies {[round(f, 3) for f in freq]}; the "
                              f"renormalised nucleus is {[round(w, 3) for w in want]}.")


def check_top_p(top_p_fn: Callable, draws: int = 20000) -> Report:
    """Grade `top_p(logits [B, V], top_p [B])`: logits, those outside each row's nucleus at -inf."""
    def known_answers():
        for p, want in [(0.45, [1]), (0.75, [1, 3]), (0.9, [1, 2, 3]), (1e-6, [1]),
                        (1.0, [0, 1, 2, 3])]:
            got = _kept(top_p_fn, PROBS, p)
            if got != want:
                raise ExerciseFailure(
                    f"with probabilities {PROBS} and top_p={p}, your filter kept tokens {got}; the "
                    f"nucleus is {want}: the most likely tokens, in order, until their total "
                    f"reaches top_p (the top token always stays, and top_p=1 keeps everything).")

    def rows_and_values():
        logits = torch.tensor([PROBS, PROBS[::-1]]).log()
        out = top_p_fn(logits.clone(), torch.tensor([0.75, 1.0]))
        if not torch.equal(out[1], logits[1]):
            raise ExerciseFailure("row 1 had top_p=1.0 (off) but came back changed: each row has "
                                  "its own top_p.")
        kept = out[0] != float("-inf")
        if not torch.allclose(out[0][kept], logits[0][kept]):
            raise ExerciseFailure("the tokens kept in the nucleus had their logits changed: only "
                                  "set the others to -inf (the softmax after the filter "
                                  "renormalises).")

    def engine_equality():
        params = SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, seed=7, ignore_eos=True)
        _, ours, _ = generate(EngineHooks(), params=params)
        _, theirs, _ = generate(EngineHooks(top_p=top_p_fn), params=params)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                j = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                raise ExerciseFailure(f"with seed 7, temperature 0.9 and top_p 0.8, request {i}'s "
                                      f"token {j} is {b} with your filter and {a} with the "
                                      f"engine's own: the two filters kept different tokens for "
                                      f"some row of the batch.")

    return run_checks("ch05 top_p", [
        ("the nucleus is right on rows with a known answer", known_answers),
        ("each row uses its own top_p, and kept logits are untouched", rows_and_values),
        ("the engine's Sampler draws from the renormalised nucleus",
         lambda: _check_sampler_distribution(top_p_fn, draws)),
        ("the engine's seeded sampling gives the same tokens as with its own filter",
         engine_equality)])
