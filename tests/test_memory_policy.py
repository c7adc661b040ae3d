"""Memory pressure and policy: priority scheduling and preemption by swap (issue 15).

Outputs under pressure must equal outputs without it: preemption, by recompute or by swap, only moves work
around. Swap must also keep each victim's computed tokens (no second prefill).
"""

import json
import subprocess
import sys

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import Sequence
from minivllm.core.swap import SwapSpace
from tests.conftest import hf_greedy

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(14 + i)] for i in range(5)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine: LLMEngine, prompts, params, priorities=None) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params,
                           priority=0 if priorities is None else priorities[i])
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return done


def engine(path, blocks: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(path, block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=32, **kw))


# ---- configuration ---------------------------------------------------------------------------------------
def test_policy_and_mode_are_checked(llama_path):
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(llama_path, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(llama_path, preemption_mode="disk")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(llama_path, swap_space=-1)
    llm = LLM(llama_path, num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="priority"):  # as vLLM: a priority needs the priority policy
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priorities"):
        LLM(llama_path, num_kv_blocks=16, scheduling_policy="priority").generate([[1, 2]], use_tqdm=False,
                                                                                 priority=[1, 2])


# ---- priority --------------------------------------------------------------------------------------------
def test_priority_orders_the_waiting_queue_with_ties_by_arrival():
    kv = KVCacheManager(8, 4)
    sched = Scheduler(kv, policy="priority")
    for rid, prio, t in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 2, 2.0), ("d", 1, 3.0), ("e", 0, 4.0)]:
        sched.add(Sequence(rid, [1, 2], greedy(1), arrival_time=t, priority=prio))
    assert [r.request_id for r in sched.waiting] == ["b", "e", "d", "a", "c"]


def urgent_scenario(eng: LLMEngine, priorities: bool) -> tuple[list[str], dict[str, list[int]]]:
    """Two long requests fill a 12-block pool; a short one arrives later, urgent if `priorities`."""
    eng.add_request("low", PROMPTS[0], greedy(24), priority=5 if priorities else 0)
    eng.add_request("mid", PROMPTS[1], greedy(24), priority=3 if priorities else 0)
    for _ in range(3):
        eng.step()
    eng.add_request("urgent", PROMPTS[2], greedy(8))
    order, outputs = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    return order, outputs


def test_urgent_request_preempts_lower_priority_and_outputs_match(checkpoints):
    path, hf = checkpoints["llama"]
    eng = engine(path, 12, scheduling_policy="priority")
    order, outputs = urgent_scenario(eng, priorities=True)
    assert order[0] == "urgent", order
    victims = {rid for t in eng.trace for rid in t.preempted}
    assert "urgent" not in victims and "low" in victims  # the largest (priority, arrival) goes first
    for rid, prompt, n in [("low", PROMPTS[0], 24), ("mid", PROMPTS[1], 24), ("urgent", PROMPTS[2], 8)]:
        assert outputs[rid] == hf_greedy(hf, prompt, n)


def test_fcfs_lets_the_late_request_wait(llama_path):
    order, _ = urgent_scenario(engine(llama_path, 12), priorities=False)
    assert order[0] == "low" and order[-1] == "urgent", order


# ---- swap ------------------------------------------------------------------------------------------------
SWAP_PARAMS = [greedy(20), SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=16, ignore_eos=True), greedy(12)]


@pytest.fixture(scope="module")
def unpressured(llama_path) -> dict[str, list[int]]:
    """Greedy and seeded sampling, n=2 included, with a roomy pool: what every pressured run must give. On the
    torch backend; the Triton kernels compute the same tokens (tests/test_kernels.py), and interpreted they are
    slow, so they run only the pressured side."""
    return run(engine(llama_path, 200), PROMPTS[:4], SWAP_PARAMS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swap_and_recompute_match_unpressured_runs(llama_path, unpressured, backend):
    """The same tokens with a roomy pool, recompute and swap. Recompute is the same on either backend; Triton
    checks swap's copies of its cache."""
    results = {}
    for mode in ("recompute", "swap") if backend == "torch" else ("swap",):
        eng = engine(llama_path, 16, attention_backend=backend, preemption_mode=mode, swap_space=0.01)
        results[mode] = run(eng, PROMPTS[:4], SWAP_PARAMS)
        assert eng.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
        stats = eng.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        if mode == "swap":
            assert stats["num_blocks_swapped_out"] == stats["num_blocks_swapped_in"] > 0
            assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]
            assert eng.runner.block_copier.swap_bytes == 2 * stats["num_blocks_swapped_in"] * eng.runner.bytes_per_block
        results[mode + "_prefill"] = stats["num_prefill_tokens_computed"]
    assert results["swap"] == unpressured
    if backend == "torch":
        assert results["recompute"] == unpressured
        assert results["swap_prefill"] < results["recompute_prefill"], "a swapped-in request is not prefilled again"


def test_swap_runs_the_same_under_python_O(llama_path):
    """`python -O` drops every assert: nothing the engine does may live inside one (a swap-in's allocation once
    did). The same swap workload, run here and under -O, gives the same tokens and leaves no block held."""
    code = (f"import json; from tests.test_memory_policy import engine, run, greedy, PROMPTS; "
            f"eng = engine({str(llama_path)!r}, 12, preemption_mode='swap', swap_space=0.01); "
            f"out = run(eng, PROMPTS[:3], greedy(24)); s = eng.stats(); "
            f"print(json.dumps([out, s['num_blocks_swapped_in'], s['num_free_blocks'] == s['num_total_blocks']]))")
    optimized = json.loads(subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                                          check=True, timeout=300).stdout)
    eng = engine(llama_path, 12, preemption_mode="swap", swap_space=0.01)
    out, stats = run(eng, PROMPTS[:3], greedy(24)), eng.stats()
    assert optimized == [out, stats["num_blocks_swapped_in"], True] and optimized[1] > 0


def test_swap_is_in_the_trace_and_keeps_computed_tokens(llama_path):
    eng = engine(llama_path, 12, preemption_mode="swap", swap_space=0.01)
    run(eng, PROMPTS[:3], greedy(24))
    outs = [t for t in eng.trace if t.swapped_out]
    ins = [t for t in eng.trace if t.swapped_in]
    assert outs and ins and all(t.num_swap_bytes > 0 for t in outs + ins)
    rid = next(iter(outs[0].swapped_out))
    back = next(t for t in ins if rid in t.swapped_in)
    entry = next(e for e in back.scheduled if e.request_id == rid)
    assert entry.num_computed_before > 0 and entry.num_tokens == 1  # it resumes decoding where it stopped


def test_swap_falls_back_to_recompute_when_the_host_is_full(llama_path):
    eng = engine(llama_path, 12, preemption_mode="swap", swap_space=1e-9)  # room for no block
    assert eng.swap.num_blocks == 0
    reference = run(engine(llama_path, 200), PROMPTS[:3], greedy(24))
    assert run(eng, PROMPTS[:3], greedy(24)) == reference
    assert eng.scheduler.num_preemptions > 0 and eng.stats()["num_blocks_swapped_out"] == 0


def test_abort_while_swapped_out_frees_host_blocks(llama_path):
    eng = engine(llama_path, 12, preemption_mode="swap", swap_space=0.01)
    for i in range(3):
        eng.add_request(str(i), PROMPTS[i], greedy(30))
    while not eng.swap.tables:
        eng.step()
    eng.abort_request(list(eng.swap.tables))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.swap.num_free_blocks == eng.swap.num_blocks and not eng.swap.tables
    assert eng.kv.num_free_blocks == 12


def test_swap_space_unit():
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    swap = SwapSpace(3)
    req = Sequence("r", [1, 2, 3, 4, 5], greedy(4))
    assert kv.allocate(req, 5)
    req.num_computed_tokens = 5
    assert swap.swap_out(kv, req) == [(0, 0), (1, 1), (2, 2)] and kv.num_free_blocks == 4
    other = Sequence("o", [1] * 7, greedy(1))
    assert kv.allocate(other, 7)  # someone else takes the GPU blocks meanwhile
    assert swap.swap_in(kv, req, 1) is None  # no room yet: nothing changes
    assert swap.is_swapped(req) and swap.num_free_blocks == 0
    kv.free(other)
    pairs = swap.swap_in(kv, req, 1)
    assert [h for h, _ in pairs] == [0, 1, 2] and len(kv.block_tables["r"]) == 3 and swap.num_free_blocks == 3
    assert isinstance(swap.pool, BlockPool)


# ---- the server ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_server_accepts_priority_as_vllm_does(llama_path, policy):
    import httpx

    from minivllm.server import build_app
    from tests.test_server import ServerThread

    srv = ServerThread(build_app(LLMEngine(EngineConfig(llama_path, num_kv_blocks=32, scheduling_policy=policy))))
    try:
        url = f"http://127.0.0.1:{srv.port}/v1/completions"
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "priority": 2}
        r = httpx.post(url, json=body, timeout=30)
        if policy == "priority":
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert httpx.post(url, json={**body, "priority": "high"}, timeout=30).status_code in (400, 422)
    finally:
        srv.stop()


# ---- the widgets -----------------------------------------------------------------------------------------
def test_widgets_draw_swaps_forks_and_copies(llama_path):
    from minivllm import BeamSearchParams, widgets

    eng = engine(llama_path, 12, preemption_mode="swap", swap_space=0.01)
    run(eng, PROMPTS[:3], greedy(24))
    trace = list(eng.trace)
    totals = widgets.swap_totals(trace)
    assert totals["blocks_out"] == totals["blocks_in"] == eng.stats()["num_blocks_swapped_out"] > 0
    assert totals["bytes"] == eng.runner.block_copier.swap_bytes
    assert widgets.timeline(trace).count("swapped out") == sum(len(t.swapped_out) for t in trace)

    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=4))
    rows = widgets.fork_rows(llm.engine.trace)
    kinds = {kind for row in rows for _, kind in row.blocks}
    assert {"shared", "copied"} <= kinds and any(row.forked for row in rows)
    page = widgets.fork_html(llm.engine.trace)
    assert "(forked)" in page and "×3" in page
