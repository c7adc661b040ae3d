"""Chapter 03 exercise: `BlockPool.allocate` and `BlockPool.free`, with reference counts.

The learner subclasses BlockPool (keeping its __init__, touch, cache and lookup) and writes the two
methods every block goes through. The checker tries the pool alone, then runs it inside the real
engine on random workloads (hypothesis) checking after every step that each block's count equals the
block tables holding it, and finally compares the engine's greedy tokens with transformers under
preemption and prefix caching.
"""

from __future__ import annotations

from minivllm.exercises.common import (
    check_greedy_matches_transformers,
    for_all_workloads,
    run_workload,
)
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks

WORDS = {"alloc": "allocated to", "hit": "shared (prefix-cache hit) with", "free": "freed by",
         "fork": "forked to", "cow": "copied on write for", "swap_out": "swapped out by",
         "swap_in": "swapped in for"}


def _history(record, block_id: int) -> str:
    """What happened to one block in one step, in words."""
    said = []
    for kind, rid, b in record.kv_events:
        if b == block_id:
            why = (" (which finished)" if rid in record.finished else
                   " (which was preempted)" if rid in record.scheduler_output.preempted else "")
            said.append(f"{WORDS.get(kind, kind)} request '{rid}'{why}")
    return "; in that step it was " + ", then ".join(said) if said else ""


def check_pool_invariants(engine, record) -> None:
    """Each block's ref_cnt equals the number of block tables holding it; only free blocks queue."""
    pool, holders = engine.kv.pool, {}
    for rid, table in engine.kv.block_tables.items():
        for b in table:
            holders.setdefault(b, []).append(rid)
    for block in pool.blocks:
        b, held = block.block_id, holders.get(block.block_id, [])
        names = " (" + ", ".join(f"'{r}'" for r in held) + ")" if held else ""
        if block.ref_cnt != len(held):
            raise ExerciseFailure(f"after step {record.step}, block {b} has ref_cnt "
                                  f"{block.ref_cnt} but {len(held)} request(s) hold "
                                  f"it{names}{_history(record, b)}.")
        if (b in pool.free_queue) != (block.ref_cnt == 0):
            state = ("is in the free queue although" if b in pool.free_queue
                     else "is missing from the free queue, so")
            raise ExerciseFailure(f"after step {record.step}, block {b} {state} {len(held)} "
                                  f"request(s) hold it{names}{_history(record, b)}.")
    num_free = sum(1 for blk in pool.blocks if blk.ref_cnt == 0)
    if len(pool.free_queue) != num_free:
        raise ExerciseFailure(f"after step {record.step}, the free queue holds "
                              f"{len(pool.free_queue)} entries for {num_free} free blocks: one is "
                              f"in it twice.")


def _hands_out_and_takes_back(pool_cls: type) -> None:
    """Every block handed out once, with ref_cnt 1, and every one taken back by free."""
    pool = pool_cls(4)
    ids = [pool.allocate() for _ in range(4)]
    if sorted(ids) != [0, 1, 2, 3]:
        raise ExerciseFailure(f"four allocations from a pool of 4 blocks returned {ids}: each "
                              f"block once.")
    if any(pool.blocks[b].ref_cnt != 1 for b in ids) or pool.num_free_blocks != 0:
        raise ExerciseFailure(f"after allocating all 4 blocks, their ref_cnt are "
                              f"{[pool.blocks[b].ref_cnt for b in ids]} (should be 1 each) and "
                              f"{pool.num_free_blocks} remain in the free queue (should be 0).")
    for b in ids:
        pool.free(b)
    if pool.num_free_blocks != 4 or any(blk.ref_cnt for blk in pool.blocks):
        raise ExerciseFailure(f"after freeing all 4 blocks, {pool.num_free_blocks} are in the "
                              f"free queue and their ref_cnt are "
                              f"{[blk.ref_cnt for blk in pool.blocks]}.")


def _shared_blocks_wait_for_the_last_reader(pool_cls: type) -> None:
    """A shared block returns to the queue only with its last reader; a double free raises."""
    pool = pool_cls(3)
    b = pool.allocate()
    pool.touch(b)  # a second request shares it (a prefix-cache hit)
    pool.free(b)
    if b in pool.free_queue or pool.blocks[b].ref_cnt != 1:
        raise ExerciseFailure(f"block {b} was shared by two requests and one freed it: it must "
                              f"stay out of the free queue with ref_cnt 1 (it has "
                              f"{pool.blocks[b].ref_cnt}, and is "
                              f"{'in' if b in pool.free_queue else 'not in'} the queue). "
                              f"Otherwise it could be handed to a third request while the "
                              f"second still reads it.")
    pool.free(b)
    if b not in pool.free_queue:
        raise ExerciseFailure(f"block {b}'s last reader freed it, but it is not back in the "
                              f"free queue.")
    try:
        pool.free(b)
    except RuntimeError:
        pass
    else:
        raise ExerciseFailure(f"freeing block {b} a third time (its ref_cnt was already 0) did "
                              f"not raise RuntimeError: a double free must be refused, or the "
                              f"pool silently breaks.")


def _reuse_order_and_eviction(pool_cls: type) -> None:
    """Unhashed blocks are reused first, so cached prefixes live on until evicted."""
    pool = pool_cls(3)
    a, b, _ = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(a, b"prefix")
    pool.free(a)  # a holds a cached prefix: keep it as long as possible
    pool.free(b)  # b holds nothing worth keeping: reuse it first
    first = pool.allocate()
    if first != b:
        raise ExerciseFailure(f"block {a} (holding a cached prefix) and then block {b} (no "
                              f"hash) were freed; the next allocate returned {first}, but a "
                              f"block without a hash goes to the front of the queue and is "
                              f"reused first, so the cached prefix survives.")
    if pool.lookup(b"prefix") != a:
        raise ExerciseFailure(f"freeing block {a} forgot its cached prefix: a freed block "
                              f"keeps its hash until it is handed out again, so a later "
                              f"request can still hit it.")
    again = pool.allocate()
    if again != a or pool.lookup(b"prefix") is not None or pool.blocks[a].block_hash is not None:
        raise ExerciseFailure(f"when allocate hands out block {a}, which still held a cached "
                              f"prefix, it must evict it (delete it from pool.cached and clear "
                              f"block_hash): its contents are about to be overwritten.")


def check_block_pool(pool_cls: type, max_examples: int = 10) -> Report:
    """Grade a BlockPool subclass with the learner's allocate and free."""
    hooks = EngineHooks(block_pool_cls=pool_cls)

    def engine_property():
        for_all_workloads(
            hooks, lambda w: _finish_clean(run_workload(hooks, w, check_pool_invariants), w),
            max_examples)

    def equality():
        check_greedy_matches_transformers(hooks, "16 blocks of 4 tokens (preemption) and prefix "
                                          "caching", block_size=4, num_kv_blocks=16,
                                          max_num_batched_tokens=32)

    # first the pool on its own, then inside the engine
    return run_checks("ch03 BlockPool.allocate / free", [
        ("the pool hands out each block once and takes it back",
         lambda: _hands_out_and_takes_back(pool_cls)),
        ("a shared block is freed only by its last reader, and a double free raises",
         lambda: _shared_blocks_wait_for_the_last_reader(pool_cls)),
        ("unhashed blocks are reused first, and a reused cached block is evicted",
         lambda: _reuse_order_and_eviction(pool_cls)),
        ("inside the real engine, on random workloads, every block's ref_cnt equals the tables "
         "holding it", engine_property),
        ("the engine's greedy tokens still equal transformers'", equality)])


def _finish_clean(engine, w) -> None:
    if engine.kv.num_free_blocks != w["num_blocks"]:
        leaked = [b.block_id for b in engine.kv.pool.blocks
                  if b.block_id not in engine.kv.pool.free_queue]
        raise ExerciseFailure(f"every request finished, but blocks {leaked} never came back to the "
                              f"free queue.")
