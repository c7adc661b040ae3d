"""Shortest-job-first and round-robin on the real engine step: the same greedy tokens as first come,
first served, short jobs first, a bounded wait for long ones, and shared slots.

The leak-and-livelock property test for every policy is in test_block_pool_properties.py.
"""

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduling_policy import OutputLengthEstimator, ShortestJobFirst
from minivllm.core.sequence import FinishReason, Sequence
from minivllm.hooks import EngineHooks

POLICIES = ["fcfs", "priority", "sjf", "round_robin"]
PROMPTS = [[(5 * i + j) % 200 + 1 for j in range(6 + 3 * i)] for i in range(6)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine(path, policy: str, **kw) -> LLMEngine:
    settings = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=2)
    return LLMEngine(EngineConfig(path, scheduling_policy=policy, **{**settings, **kw}))


def run(eng: LLMEngine, requests: dict[int, list[tuple[str, list[int], int]]]) -> dict:
    """Add requests at the steps they arrive ({step: [(id, prompt, max_tokens)]}); run to the end.
    Returns {id: (tokens, step of first token, step finished)}."""
    first, done, step = {}, {}, 0
    while step <= max(requests) or eng.has_unfinished_requests():
        for rid, prompt, n in requests.get(step, []):
            eng.add_request(rid, prompt, greedy(n))
        for out in eng.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), first[out.request_id], step)
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return done


def test_greedy_tokens_are_the_same_under_every_policy(llama_path):
    """Policies change who runs when, never what a request computes: preemption and yielding
    recompute (or swap back) exactly the same tokens."""
    workload = {0: [(str(i), p, 6 + 2 * i) for i, p in enumerate(PROMPTS)]}
    results = {}
    for policy in POLICIES:
        for mode in ("recompute", "swap"):
            eng = engine(llama_path, policy, num_kv_blocks=14, round_robin_quantum=2,
                         preemption_mode=mode)
            results[policy, mode] = {rid: r[0] for rid, r in run(eng, workload).items()}
            if policy == "round_robin":
                assert eng.scheduler.num_preemptions > 0, "slots must have been yielded"
    reference = results["fcfs", "recompute"]
    assert all(tokens == reference for tokens in results.values())


def test_sjf_runs_short_requests_before_long_ones(llama_path):
    workload = {0: [("long", PROMPTS[5], 40), ("short", PROMPTS[0], 2), ("mid", PROMPTS[1], 8)]}
    fcfs = run(engine(llama_path, "fcfs", max_num_seqs=1), workload)
    sjf = run(engine(llama_path, "sjf", max_num_seqs=1), workload)
    assert sorted(fcfs, key=lambda r: fcfs[r][2]) == ["long", "short", "mid"]
    assert sorted(sjf, key=lambda r: sjf[r][2]) == ["short", "mid", "long"]


@pytest.mark.parametrize("aging", [8, 10_000])
def test_sjf_aging_bounds_the_wait_of_a_long_request(llama_path, aging):
    """A stream of one-token requests, one arriving every step, would keep a long request waiting
    forever under pure SJF. With aging it is admitted within `aging` steps plus its turn among the
    aged (here none are ahead of it)."""
    workload = {step: [(f"s{step}", PROMPTS[0], 1)] for step in range(80)}
    workload[0].append(("long", PROMPTS[2], 4))
    eng = engine(llama_path, "sjf", max_num_seqs=1, sjf_aging_steps=aging)
    result = run(eng, workload)
    if aging == 8:
        assert result["long"][1] <= aging + 2
    else:  # no aging within the run: starved until the stream ends
        assert result["long"][1] > 79


def test_sjf_learns_output_lengths_and_the_prediction_is_a_hook(llama_path):
    estimator = OutputLengthEstimator(weight=0.5)
    seq = Sequence("a", [1] * 10, greedy(100))
    assert estimator(seq) == 100  # never seen: max_tokens
    for n in (4, 6):
        done = Sequence("b", [2] * 12, greedy(100), output_token_ids=[3] * n)
        estimator.observe(done)
    assert estimator(seq) == 5  # same length group (8..15 tokens): the moving average
    assert estimator(Sequence("c", [1] * 40, greedy(100))) == 100  # another group

    calls = []

    def predict(seq: Sequence) -> int:
        calls.append(seq.request_id)
        return 100 if seq.request_id == "short" else 1  # a deliberately wrong oracle

    hooks = EngineHooks(predict_output_tokens=predict)
    result = run(engine(llama_path, "sjf", max_num_seqs=1, hooks=hooks),
                 {0: [("long", PROMPTS[3], 12), ("short", PROMPTS[0], 2)]})
    assert "short" in calls and result["long"][2] < result["short"][2]


def test_sjf_preempts_the_request_with_the_most_work_left():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, policy="sjf")
    seqs = [Sequence(str(i), [1] * 4, greedy(n)) for i, n in enumerate((3, 30, 10))]
    assert isinstance(sched.policy, ShortestJobFirst)
    assert sched.policy.victim(seqs, None).request_id == "1"
    assert sched.policy.victim(seqs, seqs[0]) is None  # a waiting request preempts nobody


def test_round_robin_shares_slots_so_every_request_makes_progress(llama_path):
    """One slot, three requests of 12 tokens: with a quantum of 3 each gets its first token before
    any finishes; first come, first served runs them one after another."""
    workload = {0: [(str(i), PROMPTS[i], 12) for i in range(3)]}
    fcfs = run(engine(llama_path, "fcfs", max_num_seqs=1), workload)
    rr_engine = engine(llama_path, "round_robin", max_num_seqs=1, round_robin_quantum=3)
    rr = run(rr_engine, workload)
    assert max(r[1] for r in rr.values()) < min(r[2] for r in rr.values())
    assert fcfs["1"][1] > fcfs["0"][2]
    assert rr_engine.scheduler.num_preemptions >= 3 * (12 // 3 - 1)


def test_round_robin_does_not_yield_when_nobody_waits(llama_path):
    eng = engine(llama_path, "round_robin", max_num_seqs=4, round_robin_quantum=1)
    run(eng, {0: [(str(i), PROMPTS[i], 6) for i in range(3)]})
    assert eng.scheduler.num_preemptions == 0


def test_policy_settings_are_checked(llama_path):
    for bad in ({"round_robin_quantum": 0}, {"sjf_aging_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(llama_path, **bad)
    assert FinishReason.ABORT  # (the estimator ignores aborted requests: their length says nothing)
