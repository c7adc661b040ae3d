"""Chapter 14 exercise: the router's top-k choice, with and without renormalisation.

The learner's `my_route(router_logits, top_k, renormalize)` takes the router's logits [T, E] and
returns `(weights [T, k], expert_ids [T, k])`: the k experts with the largest softmax probability
for each token and the weights their outputs are summed with (rescaled to sum to 1 when
`renormalize`, as Mixtral and Qwen3-MoE with `norm_topk_prob` do; the plain probabilities
otherwise, as Qwen2-MoE does). The checker compares it with the engine's `route` on a known case
and on random logits for every k, then runs the embedded MoE through the engine and, at every MoE
layer of every step, feeds the layer's own router logits to the learner's routing and the layer's
own experts: the output must be the one the engine computed. The slots may come in any order:
the layer's sum does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.config import DEFAULT_MOE_MODEL
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.model.moe import route, sort_by_expert

KNOWN_LOGITS = [[2.0, 0.0, 1.0, -1.0], [0.0, 0.4, 3.0, 0.6]]


def _call(route_fn: Callable, logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = route_fn(logits.clone(), top_k, renormalize)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ExerciseFailure(f"my_route must return a pair (weights, expert_ids); it returned "
                              f"{type(out).__name__}.")
    weights, ids = out
    shape = (logits.shape[0], top_k)
    for name, t in (("weights", weights), ("expert_ids", ids)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ExerciseFailure(f"{name} must be a tensor of shape [tokens, top_k] = {shape}; "
                                  f"got {tuple(getattr(t, 'shape', ())) or type(t).__name__}.")
    if ids.dtype.is_floating_point:
        raise ExerciseFailure(f"expert_ids must hold integers (they index the experts); yours are "
                              f"{ids.dtype}.")
    return weights.float(), ids.long()


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (id, weight) pairs sorted by expert id: the slot order does not matter."""
    ids_sorted, perm = ids.sort(dim=-1)
    return weights.gather(-1, perm), ids_sorted


def _compare(route_fn: Callable, logits: torch.Tensor, top_k: int, renormalize: bool,
             case: str) -> None:
    weights, ids = _call(route_fn, logits, top_k, renormalize)
    want_w, want_ids = _by_expert(*route(logits, top_k, renormalize))
    got_w, got_ids = _by_expert(weights, ids)
    rule = ("rescaled to sum to 1" if renormalize else
            "the softmax probabilities over all experts as they are")
    bad = (got_ids != want_ids).any(dim=-1).nonzero().flatten().tolist()
    if bad:
        t = bad[0]
        probs = torch.softmax(logits[t].float(), dim=-1)
        hint = ""
        if set(got_ids[t].tolist()) == set(torch.topk(-probs, top_k).indices.tolist()):
            hint = " Yours are the k *smallest*: topk returns the largest by default."
        elif len(set(got_ids[t].tolist())) < top_k:
            hint = " Yours repeats an expert: each of the k must be different."
        raise ExerciseFailure(f"{case}: for token {t} the router's k={top_k} experts are "
                              f"{want_ids[t].tolist()} (the largest probabilities, "
                              f"{[round(p, 3) for p in probs[want_ids[t]].tolist()]}); yours are "
                              f"{got_ids[t].tolist()}.{hint}")
    if torch.allclose(got_w, want_w, atol=1e-5, rtol=1e-4):
        return
    t = int((got_w - want_w).abs().amax(dim=-1).argmax())
    sums = got_w.sum(dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    hint = ""
    if torch.allclose(got_w, logits.float().gather(-1, got_ids)):  # got_ids: sorted by id
        hint = " Those are the raw logits: the weights come from a softmax over all experts."
    elif renormalize and not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
        hint = (f" With renormalize=True each token's k weights sum to 1; yours sum to "
                f"{sums[t].item():.4f}: divide by their sum.")
    elif not renormalize and torch.allclose(sums, torch.ones_like(sums), atol=1e-4) and top_k < \
            logits.shape[-1]:
        hint = (" With renormalize=False they are the probabilities as the softmax over all "
                f"{logits.shape[-1]} experts gave them (they sum to less than 1); yours sum to 1: "
                "you rescaled them, or took the softmax over the k chosen logits only.")
    elif torch.allclose(got_w, probs.gather(-1, got_ids), atol=1e-5) and renormalize:
        hint = " Those are the probabilities before rescaling: divide each token's by their sum."
    raise ExerciseFailure(f"{case}: token {t}'s weights for experts {want_ids[t].tolist()} should "
                          f"be {[round(w, 4) for w in want_w[t].tolist()]} ({rule}); yours are "
                          f"{[round(w, 4) for w in got_w[t].tolist()]}.{hint}")


def _engine_layers_agree(route_fn: Callable, prompts: list[str], max_tokens: int) -> None:
    """Run the embedded MoE through the engine, keep each MoE layer's input and output at every
    step (a torch forward hook, nothing patched), then recompute each with the learner's routing
    and the layer's own router and experts."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.model.moe_layer import MoeFeedForward
    from minivllm.sampling_params import SamplingParams

    llm = LLM(DEFAULT_MOE_MODEL, device="cpu", dtype="float32", enforce_eager=True, trace_steps=0)
    seen: list[tuple[int, MoeFeedForward, torch.Tensor, torch.Tensor]] = []
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoeFeedForward)]
    handles = [m.register_forward_hook(
        lambda mod, args, out, i=i: seen.append((i, mod, args[0].detach(), out.detach())))
        for i, m in enumerate(layers)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise RuntimeError("the engine ran no MoE layer: is the embedded MoE a MoE?")
    for call, (layer, mod, x, engine_out) in enumerate(seen):
        with torch.inference_mode():
            logits = mod.gate(x)
            weights, ids = _call(route_fn, logits, mod.top_k, mod.renormalize)
            experts = mod.experts
            yours = mod.run_experts(x, weights, sort_by_expert(ids, mod.num_experts),
                                    experts.gate_up_proj, experts.down_proj,
                                    experts.gate_up_scale, experts.down_scale)
        if not torch.allclose(yours, engine_out, atol=1e-5, rtol=1e-4):
            t = int((yours - engine_out).abs().amax(dim=-1).argmax())
            want_w, want_ids = route(logits, mod.top_k, mod.renormalize)
            same = sorted(ids[t].tolist()) == sorted(want_ids[t].tolist())
            hint = (" The same experts with other weights: each weight must stay with its expert's "
                    "slot." if same else "")
            raise ExerciseFailure(
                f"in the engine's forward pass {call // len(layers)}, MoE layer {layer} "
                f"({len(x)} tokens), token {t}: with your routing the layer's experts give an "
                f"output off by {(yours - engine_out)[t].abs().max().item():.2e}. The engine "
                f"routed it to experts {want_ids[t].tolist()} with weights "
                f"{[round(w, 4) for w in want_w[t].tolist()]}; yours said "
                f"{ids[t].tolist()} with {[round(w, 4) for w in weights[t].tolist()]}.{hint}")


def check_route(route_fn: Callable, prompts: tuple[str, ...] = ("Hi, my name is", "Hello there"),
                max_tokens: int = 8) -> Report:
    """Grade `my_route(router_logits [T, E], top_k, renormalize) -> (weights, expert_ids)`."""

    def known_answer():
        logits = torch.tensor(KNOWN_LOGITS)
        _compare(route_fn, logits, 2, True, "4 experts, k=2, renormalised (Mixtral's rule)")
        _compare(route_fn, logits, 2, False, "4 experts, k=2, not renormalised (Qwen2-MoE's rule)")

    def random_logits():
        gen = torch.Generator().manual_seed(0)
        for experts in (8, 9, 64):
            logits = torch.randn(33, experts, generator=gen) * 3
            for top_k in sorted({1, 2, 4, experts // 2, experts}):
                for renormalize in (True, False):
                    _compare(route_fn, logits, top_k, renormalize,
                             f"{experts} experts, k={top_k}, renormalize={renormalize}")

    return run_checks("ch14 top-k routing", [
        ("a known case, renormalised and not", known_answer),
        ("random logits, 8, 9 and 64 experts, every k from 1 to all, both rules", random_logits),
        ("the embedded MoE in the engine: every MoE layer of every step gives the engine's output "
         "with your routing", lambda: _engine_layers_agree(route_fn, list(prompts), max_tokens))])
