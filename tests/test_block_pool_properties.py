"""Property tests: under random workloads the block pool and scheduler never leak, double-free or overspend.

They drive the real engine step (`LLMEngine.step`: schedule, run a tiny random model, update, outputs) with
random arrivals, all four scheduling policies, priorities, aborts, n > 1, lengths, chunking, preemption (by
recompute or by swap to a tiny host pool) and shared prefixes, and check the block bookkeeping of both pools
after every step through a step observer, the way a chapter would watch the engine.
"""

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_sizing import kv_bytes_per_block
from minivllm.core.sequence import SequenceStatus
from minivllm.engine.beam_search import BeamSearch, BeamSearchParams
from tests.conftest import build_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prop") / "llama"
    build_checkpoint("llama", path, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return path


@pytest.fixture(scope="module")
def windowed_paths(tmp_path_factory, tiny_path):
    """{window: checkpoint}: None the llama; 3 and 8 a Mistral whose one layer slides (blocks leave with it);
    "hybrid" a Qwen2 with a full-attention layer and a sliding one (window 3): two groups, a table each."""
    import torch
    import transformers as tf

    from tests.conftest import TINY

    paths = {None: tiny_path}
    for window in (3, 8):
        torch.manual_seed(0)
        paths[window] = tmp_path_factory.mktemp("prop") / f"mistral{window}"
        tf.MistralForCausalLM(tf.MistralConfig(**{**TINY, "num_hidden_layers": 1, "hidden_size": 32,
                                                  "intermediate_size": 64, "sliding_window": window})
                              ).save_pretrained(paths[window])
    paths["hybrid"] = tmp_path_factory.mktemp("prop") / "hybrid"
    build_checkpoint("qwen2", paths["hybrid"], num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                     sliding_window=3, use_sliding_window=True, max_window_layers=1)
    return paths


def check_host_pool(scheduler) -> None:
    """Host blocks: each held by exactly one swapped request, which waits and holds no GPU block."""
    swap = scheduler.swap
    if swap is None:
        return
    held = [b for table in swap.tables.values() for b in table]
    assert len(held) == len(set(held)), "a host block is held twice"
    for block in swap.pool.blocks:
        assert block.ref_cnt == (block.block_id in held)
        assert (block.block_id in swap.pool.free_queue) == (block.ref_cnt == 0)
    waiting = {r.request_id for r in scheduler.waiting}
    assert set(swap.tables) <= waiting and not set(swap.tables) & set(scheduler.kv.block_tables)


def check_invariants(kv: KVCacheManager, scheduler) -> None:
    check_host_pool(scheduler)
    pool = kv.pool
    owners = {}
    for rid in kv.block_tables:
        table = kv.held_blocks(rid)  # less the blocks a sliding window has passed
        assert len(table) == len(set(table)), f"{rid} holds a block twice"
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0), "ref count != number of tables holding it"
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    for h, b in pool.cached.items():
        assert pool.blocks[b].block_hash == h
    assert {r.request_id for r in scheduler.running} <= set(kv.block_tables)
    assert all(r.status == SequenceStatus.RUNNING for r in scheduler.running)
    for r in scheduler.running:
        assert kv.num_logical_blocks(kv.block_tables[r.request_id]) * kv.block_size >= r.num_computed_tokens
        assert r.num_computed_tokens <= r.num_tokens


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 40),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "budget": st.integers(1, 64),
    "max_seqs": st.integers(1, 8),
    "caching": st.booleans(),
    "chunking": st.booleans(),
    "seed": st.integers(0, 10_000),
    # a sliding window returns blocks as it passes them; "hybrid": only its sliding layers' blocks
    "window": st.sampled_from([None, None, 3, 8, "hybrid"]),
    "policy": st.sampled_from(["fcfs", "priority", "sjf", "round_robin"]),
    "quantum": st.integers(1, 4),  # round_robin's; sjf ages by 4x as many steps
    "swap_blocks": st.sampled_from([0, 4, 64]),  # 0: recompute; else swap to a host pool of that many blocks
    "requests": st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 12), st.integers(1, 2),
                                   st.integers(0, 2)),
                         min_size=1, max_size=10),  # (prompt length, max_tokens, arrival step, n, priority)
})


@settings(max_examples=60, deadline=None)
@given(workload)
def test_engine_steps_never_leak_or_overspend(windowed_paths, w):
    rng = random.Random(w["seed"])
    budget = w["budget"] if w["chunking"] else max(w["budget"], w["num_blocks"] * w["block_size"])
    bytes_per_block = kv_bytes_per_block(1, w["block_size"], 2, 8, 4)  # 1 layer, 2 kv heads of 8, float32
    path = windowed_paths[w["window"]]
    engine = LLMEngine(EngineConfig(path, block_size=w["block_size"], num_kv_blocks=w["num_blocks"],
                                    max_num_seqs=w["max_seqs"], max_num_batched_tokens=budget,
                                    enable_prefix_caching=w["caching"], enable_chunked_prefill=w["chunking"],
                                    trace_steps=0, seed=w["seed"], scheduling_policy=w["policy"],
                                    round_robin_quantum=w["quantum"], sjf_aging_steps=4 * w["quantum"],
                                    preemption_mode="swap" if w["swap_blocks"] else "recompute",
                                    swap_space=w["swap_blocks"] * bytes_per_block / 2**30))
    assert engine.swap.num_blocks <= w["swap_blocks"]
    capacity = w["num_blocks"] // engine.kv.num_groups * w["block_size"]  # a block of tokens: one per group
    first_scheduled: dict[str, int] = {}  # request id -> the step it first ran
    keys: dict[str, tuple] = {}  # request id -> (priority, arrival, n>1 index)

    def check(eng, record):
        assert record.scheduler_output.num_tokens <= budget
        assert len(eng.scheduler.running) <= w["max_seqs"]
        check_invariants(eng.kv, eng.scheduler)
        for s in record.scheduler_output.scheduled:
            first_scheduled.setdefault(s.request_id, record.step)

    engine.add_step_observer(check)
    pending, live, finished = [], set(), set()
    for i, (plen, max_tokens, arrival, n, priority) in enumerate(w["requests"]):
        plen = min(plen, capacity - 1)
        max_tokens = min(max_tokens, capacity - plen)
        prompt = [rng.randrange(3) for _ in range(plen)]  # tiny alphabet: many shared prefixes
        pending.append((arrival, str(i), prompt, SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0),
                        priority if w["policy"] == "priority" else 0))
    for step in range(3000):
        for _, rid, prompt, params, priority in [p for p in pending if p[0] == step]:
            engine.add_request(rid, prompt, params, priority=priority)
            for seq in engine.scheduler.waiting:
                keys.setdefault(seq.request_id, (*seq.priority_key, seq.index))
            live.add(rid)
        if rng.random() < 0.05 and live:  # abort someone, wherever it is
            engine.abort_request(rng.choice(sorted(live)))
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finishes once"
                finished.add(out.request_id)
                live.discard(out.request_id)
        check_invariants(engine.kv, engine.scheduler)
        if not engine.has_unfinished_requests() and all(p[0] <= step for p in pending):
            break
    assert finished == {p[1] for p in pending}, "every request finishes or is aborted (no livelock)"
    assert engine.kv.num_free_blocks == w["num_blocks"], "every block is free at the end"
    assert not engine.kv.block_tables and not engine.scheduler.sequences
    assert engine.swap.num_free_blocks == engine.swap.num_blocks and not engine.swap.tables
    event(f"preempted: {engine.scheduler.num_preemptions > 0}, swapped: {engine.swap.num_swapped_out > 0}")
    if w["policy"] not in ("fcfs", "priority"):
        return  # sjf reorders by predicted work, round_robin keeps arrival order only for admission
    # no starvation within a priority level: first runs follow (priority level, arrival) order there
    ran = sorted(first_scheduled, key=lambda rid: keys[rid])
    for a, b in zip(ran, ran[1:]):
        if keys[a][0] == keys[b][0]:
            assert first_scheduled[a] <= first_scheduled[b], f"{b} overtook {a} within priority {keys[a][0]}"


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({
    "num_blocks": st.integers(6, 30), "block_size": st.sampled_from([1, 2, 4]), "caching": st.booleans(),
    "swap_blocks": st.sampled_from([0, 3, 64]), "width": st.integers(1, 3), "max_tokens": st.integers(1, 6),
    "prompts": st.lists(st.integers(1, 12), min_size=1, max_size=3), "seed": st.integers(0, 10_000),
    "hybrid": st.booleans()}))
def test_beam_search_under_a_tiny_pool_never_leaks(windowed_paths, w):
    """Forked tables and copy-on-write under preemption: ref counts always equal the tables holding a block."""
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    path = windowed_paths["hybrid" if w["hybrid"] else None]  # hybrid: each group copies on write
    engine = LLMEngine(EngineConfig(path, block_size=bs, num_kv_blocks=w["num_blocks"], trace_steps=0,
                                    max_num_batched_tokens=16, enable_prefix_caching=w["caching"],
                                    preemption_mode="swap" if w["swap_blocks"] else "recompute",
                                    swap_space=w["swap_blocks"] * kv_bytes_per_block(1, bs, 2, 8, 4) / 2**30))
    engine.add_step_observer(lambda eng, record: check_invariants(eng.kv, eng.scheduler))
    capacity = w["num_blocks"] // engine.kv.num_groups * bs
    max_tokens = min(w["max_tokens"], capacity // 2)
    prompts = [[rng.randrange(3) for _ in range(min(n, capacity - max_tokens))] for n in w["prompts"]]
    outs = BeamSearch(engine).run(prompts, BeamSearchParams(beam_width=w["width"], max_tokens=max_tokens))
    assert [len(o.sequences) for o in outs] == [w["width"]] * len(prompts)
    assert all(len(s.tokens) == len(p) + max_tokens for o, p in zip(outs, prompts) for s in o.sequences)
    assert engine.kv.num_free_blocks == w["num_blocks"] and not engine.kv.block_tables
    assert not engine.scheduler.sequences and not engine.runner.sequences
    assert engine.swap.num_free_blocks == engine.swap.num_blocks
    event(f"preempted: {engine.scheduler.num_preemptions > 0}, copied on write: {engine.kv.num_cow_copies > 0}")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.lists(st.tuples(st.sampled_from("aftc"), st.integers(0, 19)), max_size=80))
def test_block_pool_ref_counts(num_blocks, ops):
    """Random allocate / touch / free / cache: counts stay consistent, double frees are refused."""
    pool = BlockPool(num_blocks)
    held: list[int] = []
    for op, arg in ops:
        if op == "a" and pool.num_free_blocks:
            held.append(pool.allocate())
        elif op == "t" and held:
            pool.touch(held[arg % len(held)])
            held.append(held[arg % len(held)])
        elif op == "f" and held:
            pool.free(held.pop(arg % len(held)))
        elif op == "c" and held:
            pool.cache(held[arg % len(held)], arg)
        for b in pool.blocks:
            assert b.ref_cnt == held.count(b.block_id)
        assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for b in held:
        pool.free(b)
    assert pool.num_free_blocks == num_blocks
    try:
        pool.free(0)
    except RuntimeError:
        pass
    else:
        raise AssertionError("double free must raise")
