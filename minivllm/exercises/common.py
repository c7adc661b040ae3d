"""What several checkers share: running the real engine with a learner's hooks on the embedded
model, and comparing its greedy tokens with Hugging Face transformers.

Both run on the CPU in float32, also on a GPU machine: a half-precision run could differ from
transformers' float32 argmax by rounding alone. The comparison is by teacher forcing: one
transformers forward pass over prompt + the engine's tokens, whose argmax at every position must be
the engine's next token. That equals comparing two greedy generations, costs one pass per prompt
instead of one per token, and names the first token that differs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.exercises.report import ExerciseFailure
from minivllm.hooks import EngineHooks
from minivllm.sampling_params import SamplingParams

PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there",
           "Once upon a time there was a little dog named Max who liked to run in the park with "
           "his friends."]


def generate(hooks: EngineHooks, prompts: Sequence[str | list[int]] = PROMPTS, max_tokens: int = 16,
             params: SamplingParams | None = None,
             **engine_args) -> tuple[list[list[int]], list[list[int]], LLM]:
    """(prompt ids, generated ids, the LLM) for greedy generation (or `params`) with the hooks."""
    llm = LLM(DEFAULT_MODEL, hooks=hooks, trace_steps=0, **{"device": "cpu", **engine_args})
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids)
                                                      for o in outs], llm


def transformers_mismatch(prompt_ids: Sequence[list[int]],
                          output_ids: Sequence[list[int]]) -> str | None:
    """None if every generated token is transformers' greedy choice, else where the first is not."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a notebook cell should show the verdict, not a loading bar
    try:
        model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    finally:
        logging.enable_progress_bar()
    for i, (prompt, out) in enumerate(zip(prompt_ids, output_ids)):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
        best = logits.argmax(dim=-1).tolist()
        for j, (ours, theirs) in enumerate(zip(out, best)):
            if ours != theirs:
                return (f"request {i}'s generated token {j} is {ours}, but transformers' greedy "
                        f"choice after the same tokens is {theirs}")
    return None


def check_greedy_matches_transformers(hooks: EngineHooks, setting: str, prompts=PROMPTS,
                                      max_tokens: int = 16, **engine_args) -> LLM:
    """Greedy tokens with the learner's hooks equal transformers', and all blocks end up free."""
    prompt_ids, output_ids, llm = generate(hooks, prompts, max_tokens, **engine_args)
    wrong = transformers_mismatch(prompt_ids, output_ids)
    if wrong:
        raise ExerciseFailure(f"with {setting}, the engine's output went wrong: {wrong}.")
    stats = llm.engine.stats()
    if stats["num_free_blocks"] != stats["num_total_blocks"]:
        raise ExerciseFailure(f"with {setting}, only {stats['num_free_blocks']} of "
                              f"{stats['num_total_blocks']} blocks are free after every request "
                              f"finished: the others leaked.")
    return llm


def workloads():
    """A hypothesis strategy of small, tight workloads: few blocks (so requests get preempted),
    small token budgets (so prompts are chunked), a tiny alphabet (so prompts share prefixes)."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "num_blocks": st.integers(6, 20), "block_size": st.sampled_from([2, 4]),
        "budget": st.integers(4, 32), "max_seqs": st.integers(1, 4), "caching": st.booleans(),
        "chunking": st.booleans(), "seed": st.integers(0, 1000),
        # (prompt length, max_tokens, the step it arrives at)
        "requests": st.lists(st.tuples(st.integers(1, 24), st.integers(1, 8), st.integers(0, 4)),
                             min_size=1, max_size=5)})


# Hard cases tried first, before hypothesis' own (which start from the simplest workloads):
# preemption with chunked prefill; a tiny pool with prefix caching and whole prompts; many shared
# prefixes arriving at once.
HARD_WORKLOADS = [
    {"num_blocks": 20, "block_size": 2, "budget": 6, "max_seqs": 3, "caching": False,
     "chunking": True, "seed": 0,
     "requests": [(18, 4, 4), (15, 7, 0), (16, 7, 3), (19, 8, 1), (10, 7, 4)]},
    {"num_blocks": 8, "block_size": 4, "budget": 8, "max_seqs": 4, "caching": True,
     "chunking": False, "seed": 1, "requests": [(12, 6, 0), (9, 8, 0), (14, 5, 1), (5, 8, 2)]},
    {"num_blocks": 12, "block_size": 2, "budget": 10, "max_seqs": 4, "caching": True,
     "chunking": True, "seed": 2,
     "requests": [(8, 5, 0), (8, 5, 0), (9, 4, 0), (8, 6, 1), (7, 3, 2)]},
]


def describe(w: dict) -> str:
    reqs = ", ".join(f"'{i}': {p} prompt tokens + {m} new, arriving at step {a}"
                     for i, (p, m, a) in enumerate(w["requests"]))
    on = {k: "on" if w[k] else "off" for k in ("caching", "chunking")}
    return (f"{w['num_blocks']} blocks of {w['block_size']} tokens, a budget of {w['budget']} "
            f"tokens per step, at most {w['max_seqs']} running, prefix caching {on['caching']}, "
            f"chunked prefill {on['chunking']}; requests {reqs}")


def run_workload(hooks: EngineHooks, w: dict, observer=None, max_steps: int = 1000):
    """Drive the real LLMEngine.step through workload `w`; `observer(engine, record)` sees every
    step. Returns the engine, every request finished (else ExerciseFailure)."""
    rng = random.Random(w["seed"])
    capacity = w["num_blocks"] * w["block_size"]
    budget = w["budget"] if w["chunking"] else max(w["budget"], capacity)
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, hooks=hooks, block_size=w["block_size"],
                                    num_kv_blocks=w["num_blocks"], max_num_seqs=w["max_seqs"],
                                    max_num_batched_tokens=budget,
                                    enable_prefix_caching=w["caching"],
                                    enable_chunked_prefill=w["chunking"], trace_steps=0,
                                    seed=w["seed"], device="cpu"))
    if observer is not None:
        engine.add_step_observer(observer)
    pending = []
    system = [3 + rng.randrange(3) for _ in range(capacity)]  # every prompt starts with some of it
    for i, (plen, max_tokens, arrival) in enumerate(w["requests"]):
        plen = min(plen, capacity - 1)
        prompt = system[: plen // 2] + [3 + rng.randrange(3) for _ in range(plen - plen // 2)]
        params = SamplingParams(temperature=0, max_tokens=min(max_tokens, capacity - plen),
                                ignore_eos=True)
        pending.append((arrival, str(i), prompt, params))
    finished: set[str] = set()
    for step in range(max_steps):
        for _, rid, prompt, params in [p for p in pending if p[0] == step]:
            engine.add_request(rid, prompt, params)
        finished |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests() and step >= max(p[0] for p in pending):
            break
    missing = sorted({p[1] for p in pending} - finished)
    if missing:
        raise ExerciseFailure(f"after {max_steps} steps, request(s) {missing} never finished")
    return engine


def for_all_workloads(hooks: EngineHooks, check, max_examples: int = 12) -> None:
    """Run `check(w)` (which drives run_workload) on hypothesis' workloads; a failure says which."""
    from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              verbosity=Verbosity.quiet, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(workloads())
    def property_(w):
        try:
            check(w)
        except ExerciseFailure as failure:
            raise ExerciseFailure(f"{failure}\n(the workload: {describe(w)})") from None

    for w in reversed(HARD_WORKLOADS):
        property_ = example(w)(property_)
    property_()
