"""Chapter 11 exercise: the "priority" policy's choice of whom to preempt when blocks run out.

The checker asks the rule about running lists with a known answer, then plugs it into the real
scheduler (`EngineHooks(preempt_victim=...)`) on a tight pool where urgent requests arrive behind a
batch: every step's preemptions must be those of the engine's own priority policy, every request
must end with the same greedy tokens, and every block must come back.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks
from minivllm.sampling_params import SamplingParams


def _seq(name: str, priority: int, arrival: float) -> SimpleNamespace:
    return SimpleNamespace(request_id=name, priority=priority, arrival_time=arrival,
                           priority_key=(priority, arrival))


def _run(hooks: EngineHooks) -> tuple[dict[int, list[str]], dict[str, list[int]], LLMEngine]:
    """Four priority-9 requests fill 9 blocks; two priority-0 ones and a late priority-9 one come
    later. Returns the preemptions of every step, each request's tokens, the engine."""
    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, hooks=hooks, num_kv_blocks=9, max_num_seqs=8,
                                    scheduling_policy="priority", trace_steps=0, device="cpu"))
    preempted: dict[int, list[str]] = {}
    engine.add_step_observer(lambda e, record: preempted.update(
        {record.step: list(record.scheduler_output.preempted)} if record.scheduler_output.preempted
        else {}))
    batch = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    urgent = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    arrivals = {0: [(f"batch-{i}", 20 + 3 * i, batch, 9) for i in range(4)],
                3: [("urgent-0", 18, urgent, 0), ("urgent-1", 22, urgent, 0)],
                5: [("late-batch", 16, batch, 9)]}
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, n, params, priority in arrivals.get(step, []):
            engine.add_request(rid, list(range(5, 5 + n)), params, priority=priority)
        tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()
                       if o.finished})
        step += 1
        if step > 400:
            raise ExerciseFailure("after 400 steps some requests had still not finished: your "
                                  "rule keeps preempting without anyone making progress.")
    return preempted, tokens, engine


def check_preempt_victim(victim_fn: Callable) -> Report:
    """Grade `victim(running: list[Sequence], outranked_by: Sequence | None) -> Sequence | None`."""
    running = [_seq("a", 0, 1.0), _seq("b", 9, 2.0), _seq("c", 9, 3.0), _seq("d", 5, 4.0)]

    def known_answers():
        cases = [(None, "c", "a running request needs blocks"),
                 (_seq("w", 0, 5.0), "c", "a waiting request of priority 0 needs blocks"),
                 (_seq("w", 9, 5.0), None, "a waiting request of priority 9, which arrived after "
                                           "every running one, needs blocks")]
        for outranked_by, want, when in cases:
            got = victim_fn(list(running), outranked_by)
            got = None if got is None else got.request_id
            if got != want:
                raise ExerciseFailure(
                    f"running (priority, arrival) a=(0, 1), b=(9, 2), c=(9, 3), d=(5, 4), and "
                    f"{when}: your rule picked {got!r}, the priority policy picks {want!r}: the "
                    f"running request with the largest (priority, arrival) key, and for a waiting "
                    f"request only one whose key is larger than the waiting one's (else nobody).")
        if victim_fn([], _seq("w", 0, 5.0)) is not None:
            raise ExerciseFailure("with nobody running your rule returned someone: return None.")

    def engine_run():
        want, want_tokens, _ = _run(EngineHooks())
        got, got_tokens, engine = _run(EngineHooks(preempt_victim=victim_fn))
        for step in sorted(set(want) | set(got)):
            if want.get(step, []) != got.get(step, []):
                raise ExerciseFailure(
                    f"in the engine (9 blocks, four priority-9 requests, two priority-0 ones "
                    f"arriving at step 3, one more priority-9 one at step 5), step {step} "
                    f"preempted {got.get(step, [])} with your rule and {want.get(step, [])} with "
                    f"the engine's own priority policy.")
        if got_tokens != want_tokens:
            rid = next(r for r in want_tokens if got_tokens.get(r) != want_tokens[r])
            raise ExerciseFailure(f"request {rid!r} ended with different tokens under your rule: "
                                  f"a preempted request must come back to the same output.")
        stats = engine.stats()
        if stats["num_free_blocks"] != stats["num_total_blocks"]:
            raise ExerciseFailure(f"only {stats['num_free_blocks']} of "
                                  f"{stats['num_total_blocks']} blocks are free at the end.")

    return run_checks("ch11 preempt_victim", [
        ("the victim is right on running lists with a known answer", known_answers),
        ("the engine preempts the same requests at the same steps, tokens unchanged", engine_run)])
