"""Chapter 07 exercise: the rejection-sampling rule that verifies a sampling request's drafts.

The checker tries the rule on cases with a certain answer, then runs it thousands of times on one
step and compares the distribution of the first emitted token with the target's (the rule's whole
promise: the same distribution as the target sampling alone), and finally runs the engine with a
draft model and the rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.config import DEFAULT_DRAFT_MODEL
from minivllm.exercises.common import generate
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks
from minivllm.sampling_params import SamplingParams

P = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])  # the target: position 0, bonus
Q = torch.tensor([[0.4, 0.3, 0.2, 0.1]])  # the drafter: it likes what the target does not


def _first_tokens(verify: Callable, draft_probs: torch.Tensor | None, trials: int,
                  seed: int) -> tuple[list, int]:
    """Frequencies of the first token emitted in `trials` one-draft steps; how many drafts held."""
    gen, draft_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    counts, accepted = [0] * P.shape[1], 0
    for _ in range(trials):
        d = int(torch.multinomial(Q[0], 1, generator=draft_gen)) if draft_probs is not None else 3
        out = verify(P.clone(), [d], None if draft_probs is None else draft_probs.clone(), gen)
        if not out or len(out) > 2:
            raise ExerciseFailure(f"with one draft, verify_sampled returned {out}: it must return "
                                  f"1 token (the draft was rejected and replaced) or 2 (accepted, "
                                  f"plus the bonus token).")
        counts[out[0]] += 1
        accepted += len(out) == 2 and out[0] == d
    return [c / trials for c in counts], accepted


def _check_distribution_with_q(verify: Callable, trials: int) -> None:
    """Thousands of steps with a draft model: the first token must follow the target's p."""
    freq, accepted = _first_tokens(verify, Q, trials, 1)
    worst = max(abs(f - t) for f, t in zip(freq, P[0].tolist()))
    rate = accepted / trials
    if worst > 0.04:
        raise ExerciseFailure(
            f"over {trials} steps with drafts from q = {_rounded(Q[0])}, the first emitted "
            f"token had frequencies {[round(f, 3) for f in freq]}, but the target's p is "
            f"{_rounded(P[0])}: accept with probability min(1, p(d)/q(d)) and, on rejection, "
            f"draw from normalise(max(0, p - q)). (Drafts accepted: {rate:.0%}; the rule "
            f"accepts sum(min(p, q)) = 60%.)")
    if abs(rate - 0.6) > 0.04:
        raise ExerciseFailure(f"the output distribution is right, but {rate:.0%} of the drafts "
                              f"were kept where the rule keeps sum(min(p, q)) = 60%: "
                              f"speculation would gain less than it can.")


def check_verify_sampled(verify: Callable, trials: int = 4000) -> Report:
    """Grade `verify_sampled(target_probs [k+1, V], draft: list[int], draft_probs [k, V] | None,
    generator)`."""
    def certain_cases():
        gen = torch.Generator().manual_seed(0)
        p = torch.tensor([[0.0, 0.6, 0.4], [0.2, 0.2, 0.6], [0.0, 0.0, 1.0]])
        out = verify(p.clone(), [1, 2], p[:2].clone(), gen)
        if out[:2] != [1, 2] or len(out) != 3:
            raise ExerciseFailure(f"the drafter's q equalled the target's p, so min(1, p/q) = 1 "
                                  f"and both drafts [1, 2] must be kept, plus a bonus token from "
                                  f"the last row: you returned {out}.")
        for _ in range(20):
            out = verify(p.clone(), [0, 2], None, gen)
            if out[0] == 0:
                raise ExerciseFailure("the target gives draft token 0 probability 0, yet it was "
                                      "accepted: accept a draft d with probability min(1, p(d) / "
                                      "q(d)).")

    def distribution_point_mass():
        freq, _ = _first_tokens(verify, None, trials, 2)
        worst = max(abs(f - t) for f, t in zip(freq, P[0].tolist()))
        if worst > 0.04:
            raise ExerciseFailure(f"with an n-gram drafter (draft_probs=None: q is a point mass on "
                                  f"the draft, here always token 3), the first emitted token had "
                                  f"frequencies {[round(f, 3) for f in freq]}, but the target's p "
                                  f"is {_rounded(P[0])}.")

    def engine_runs():
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
        _, outs, llm = generate(EngineHooks(verify_sampled=verify), params=params,
                                speculative_model=DEFAULT_DRAFT_MODEL, num_speculative_tokens=3)
        stats = llm.engine.stats()
        if any(len(o) != 16 for o in outs) or stats["spec_num_proposed"] == 0:
            raise ExerciseFailure(f"with the embedded draft model, requests produced "
                                  f"{[len(o) for o in outs]} tokens (16 each expected) from "
                                  f"{stats['spec_num_proposed']} drafts.")

    return run_checks("ch07 verify_sampled", [
        ("certain cases: q = p keeps every draft, p(d) = 0 never keeps d", certain_cases),
        ("the first emitted token is distributed as the target's p (draft model)",
         lambda: _check_distribution_with_q(verify, trials)),
        ("the same with an n-gram drafter (q a point mass)", distribution_point_mass),
        ("the engine runs speculative sampling with it", engine_runs)])


def _rounded(probs) -> list[float]:
    """A probability row as a learner reads it: 0.4, not 0.4000000059604645 (float32 as double)."""
    return [round(x, 4) for x in probs.tolist()]
