"""Chapter 04 exercise: how much of a waiting prompt fits in what the step's token budget has left.

The checker tries the rule on a few cases, then runs the real engine with it on random workloads
(hypothesis), checking after every step that the step stayed within max_num_batched_tokens and that
without chunked prefill no prompt was cut, and finally compares greedy tokens with transformers
under chunking.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.exercises.common import (
    check_greedy_matches_transformers,
    for_all_workloads,
    run_workload,
)
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks


def check_budget(engine, record) -> None:
    """A step observer: the step stays within budget; without chunked prefill no prompt is cut."""
    sched, budget = record.scheduler_output, engine.scheduler.max_num_batched_tokens
    if sched.num_tokens > budget:
        raise ExerciseFailure(f"step {record.step} computed {sched.num_tokens} tokens, but the "
                              f"budget (max_num_batched_tokens) is {budget}.")
    if not engine.scheduler.enable_chunked_prefill:
        admitted = {n.request_id for n in sched.new_sequences}
        for s in sched.scheduled:
            if s.request_id in admitted and not s.samples:
                raise ExerciseFailure(f"in step {record.step}, with chunked prefill off, request "
                                      f"'{s.request_id}' was admitted for only {s.num_new_tokens} "
                                      f"of its tokens: without chunking a prompt is computed "
                                      f"whole, or waits.")


def check_prefill_chunk(prefill_chunk: Callable, max_examples: int = 10) -> Report:
    """Grade `prefill_chunk(num_remaining: int, budget: int, enable_chunked_prefill: bool)`."""
    hooks = EngineHooks(prefill_chunk=prefill_chunk)

    def cases():
        rules = [((10, 20, True), 10, "it all fits"), ((10, 10, False), 10, "it just fits"),
                 ((30, 20, True), 20, "chunked prefill takes what fits, the rest next step"),
                 ((30, 20, False), 0, "without chunked prefill the prompt waits for a step "
                  "with room"), ((1, 5, True), 1, "a decode or the last chunk is small")]
        for args, want, why in rules:
            got = prefill_chunk(*args)
            if got != want:
                raise ExerciseFailure(f"prefill_chunk(num_remaining={args[0]}, budget={args[1]}, "
                                      f"enable_chunked_prefill={args[2]}) returned {got}; it "
                                      f"should be {want}: {why}.")

    def engine_property():
        for_all_workloads(hooks, lambda w: run_workload(hooks, w, check_budget), max_examples)

    def equality():
        check_greedy_matches_transformers(hooks, "a budget of 7 tokens per step (every prompt is "
                                          "chunked)",
                                          block_size=4, num_kv_blocks=64, max_num_batched_tokens=7)

    return run_checks("ch04 prefill_chunk", [
        ("the rule gives the right chunk on a few cases", cases),
        ("inside the real engine, on random workloads, steps stay within the budget",
         engine_property),
        ("greedy tokens with chunked prompts still equal transformers'", equality)])
