"""Property tests: under random workloads the block pool and scheduler never leak, double-free or overspend.

The scheduler and KV-cache manager are plain Python, so these drive them directly with fake requests: a
"step" advances every scheduled request exactly as the engine would, without a model.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager, live: list[Request]) -> None:
    pool = kv.pool
    owners = {}
    for rid, table in kv.block_tables.items():
        assert len(table) == len(set(table)), f"{rid} holds a block twice"
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0), "ref count != number of tables holding it"
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
    for h, b in pool.cached.items():
        assert pool.blocks[b].block_hash == h
    assert {r.request_id for r in live if r.status == RequestStatus.RUNNING} <= set(kv.block_tables)
    for r in live:
        if r.request_id in kv.block_tables:
            assert len(kv.block_tables[r.request_id]) * kv.block_size >= r.num_computed_tokens


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 40),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "budget": st.integers(1, 64),
    "max_seqs": st.integers(1, 8),
    "caching": st.booleans(),
    "seed": st.integers(0, 10_000),
    "requests": st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 12)),
                         min_size=1, max_size=12),  # (prompt length, max_tokens, arrival step)
})


@settings(max_examples=150, deadline=None)
@given(workload)
def test_scheduler_never_leaks_or_overspends(w):
    rng = random.Random(w["seed"])
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["caching"])
    sched = Scheduler(kv, w["max_seqs"], w["budget"])
    capacity = w["num_blocks"] * w["block_size"]
    pending = []
    for i, (plen, max_tokens, arrival) in enumerate(w["requests"]):
        plen = min(plen, capacity - 1)
        max_tokens = min(max_tokens, capacity - plen)
        prompt = [rng.randrange(3) for _ in range(plen)]  # tiny alphabet: many shared prefixes
        pending.append((arrival, Request(str(i), prompt, SamplingParams(max_tokens=max_tokens),
                                         max_model_len=capacity)))
    live: list[Request] = []
    for step in range(2000):
        for _, req in [p for p in pending if p[0] == step]:
            sched.add(req)
            live.append(req)
        if rng.random() < 0.05 and live:  # abort someone, wherever it is
            victim = rng.choice(live)
            sched.finish(victim, "abort")
            live.remove(victim)
        out = sched.schedule()
        assert out.num_tokens <= w["budget"]
        assert len(sched.running) <= w["max_seqs"]
        check_invariants(kv, live)
        sched.update_after_step(out)
        for s in out.scheduled:
            req = s.request
            assert req.num_computed_tokens <= req.num_tokens
            if s.samples:
                req.append_output(rng.randrange(3))
                if req.num_tokens >= req.max_total_tokens:
                    sched.finish(req, "length")
                    live.remove(req)
        check_invariants(kv, live)
        if not live and all(p[0] <= step for p in pending):
            break
    assert not live and not sched.has_unfinished(), "every request finishes (no livelock)"
    assert kv.num_free_blocks == w["num_blocks"], "every block is free at the end"
    assert not kv.block_tables


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
