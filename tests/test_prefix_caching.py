"""Automatic prefix caching: shared full blocks, chained hashes, LRU eviction, identical outputs."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.block_hash import extend_block_hashes, hash_block
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sequence import Sequence

SYSTEM = list(range(10, 43))  # 33 tokens: 8 full blocks of 4, then one more token


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompts():
    return [{"prompt_token_ids": SYSTEM + q} for q in ([1, 2, 3], [4, 5], [6, 7, 8, 9, 1], [2])]


def test_hash_is_chained_to_the_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    # Python's hash() of small int tuples collides easily (hash(-1) == hash(-2)); a strong hash does not
    assert hash_block(None, [-1]) != hash_block(None, [-2])
    assert hash_block(None, [1, 2]) != hash_block(None, [258]), "token ids are not run together as bytes"


def test_block_hashes_are_computed_once_per_full_block():
    hashes = extend_block_hashes([], list(range(10)), 4)
    assert len(hashes) == 2 and hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    first = list(hashes)
    assert extend_block_hashes(hashes, list(range(13)), 4) is hashes
    assert hashes[:2] == first and len(hashes) == 3, "known blocks are kept, only the new full one is hashed"


def test_outputs_identical_with_caching_on_and_off(llama_path):
    results = {}
    for caching in (True, False):
        llm = LLM(llama_path, block_size=4, num_kv_blocks=64, enable_prefix_caching=caching)
        first = llm.generate(prompts()[:1], greedy(), use_tqdm=False)  # warms the cache
        rest = llm.generate(prompts()[1:], greedy(), use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        stats = llm.engine.stats()
        if caching:
            assert [o.num_cached_tokens for o in rest] == [32, 32, 32]
            assert stats["prefix_cache_hits"] == 96 and stats["prefix_cache_queries"] == 36 + 35 + 38 + 34
            assert stats["num_prefill_tokens_computed"] == 36 + (35 - 32) + (38 - 32) + (34 - 32)
        else:
            assert all(o.num_cached_tokens == 0 for o in rest) and stats["prefix_cache_hits"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert results[True] == results[False]


def test_shared_blocks_are_shared_in_one_batch(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=40)
    llm.generate(prompts()[:1], greedy(1), use_tqdm=False)
    eng = llm.engine
    for i, p in enumerate(prompts()[1:]):
        eng.add_request(f"q{i}", p, greedy(4))
    eng.step()
    step = eng.trace[-1]
    tables = [step.block_tables[f"q{i}"] for i in range(3)]
    assert tables[0][:8] == tables[1][:8] == tables[2][:8], "the system prompt's 8 full blocks are shared"
    assert all(step.shared_blocks[b] == 3 for b in tables[0][:8])
    assert len({t[8] for t in tables}) == 3, "each question gets its own block"
    while eng.has_unfinished_requests():
        eng.step()


def test_requests_arriving_together_share_a_cold_prefix(llama_path):
    """The first request's prefix blocks are named when scheduled, so later ones in the same step reuse them."""
    outs = {}
    for caching in (True, False):
        llm = LLM(llama_path, block_size=4, num_kv_blocks=64, enable_prefix_caching=caching)
        outs[caching] = llm.generate(prompts(), greedy(), use_tqdm=False)
        if caching:
            step = llm.engine.trace[0]
            assert len(step.scheduled) == 4, "all four are prefilled in the first step"
            assert [len(step.cache_hits.get(str(i), [])) for i in range(4)] == [0, 8, 8, 8]
            assert llm.engine.stats()["num_prefill_tokens_computed"] == 36 + 3 + 6 + 2
    assert [o.num_cached_tokens for o in outs[True]] == [0, 32, 32, 32]
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]


def test_multi_turn_conversation_reuses_earlier_turns(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    history: list[int] = list(SYSTEM)
    computed_before = 0  # tokens whose K/V the previous turn wrote: all but its last output token
    for turn in range(3):
        history += [turn + 1] * 5
        out = llm.generate({"prompt_token_ids": history}, greedy(6), use_tqdm=False)[0]
        assert out.num_cached_tokens == computed_before // 4 * 4, "every full block of the last turn is reused"
        history += out.outputs[0].token_ids
        computed_before = len(history) - 1


def test_fully_cached_prompt_still_computes_its_last_token(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(1, 17))}  # exactly 4 full blocks
    a = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    before = llm.engine.stats()["num_prefill_tokens_computed"]
    b = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert b.num_cached_tokens == 12, "the block holding the last token is recomputed"
    assert llm.engine.stats()["num_prefill_tokens_computed"] - before == 4
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_lru_eviction_under_memory_pressure(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=24)
    pool = llm.engine.kv.pool
    old = {"prompt_token_ids": list(range(50, 70))}
    llm.generate(old, greedy(4), use_tqdm=False)
    assert len(pool.cached) == 5  # 20 prompt + 3 computed outputs = 23 tokens: 5 full blocks

    def pressure(count, start):
        for k in range(count):  # other prompts push the old blocks out, least recently used first
            p = list(range(start + 20 * k, start + 20 * (k + 1)))
            llm.generate({"prompt_token_ids": p}, greedy(4), use_tqdm=False)

    pressure(4, 100)
    partial = llm.generate(old, greedy(4), use_tqdm=False)[0]
    # blocks are freed tail first, so the tail of the old prompt was evicted and its head survived
    assert 0 < partial.num_cached_tokens < 16
    pressure(5, 140)
    assert llm.generate(old, greedy(4), use_tqdm=False)[0].num_cached_tokens == 0
    assert pool.num_free_blocks == pool.num_blocks


def test_manager_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Sequence("a", list(range(12)), greedy())
    assert kv.allocate(a, 12)
    b = Sequence("b", list(range(12)), greedy())
    assert not kv.allocate(b, 12)
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_shared_prefix(llama_path, caching):
    kw = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=64)
    ref = LLM(llama_path, block_size=4, num_kv_blocks=200)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts(), greedy(12), use_tqdm=False)]
    llm = LLM(llama_path, enable_prefix_caching=caching, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy(12), use_tqdm=False)]
    assert got == expected
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.stats()["num_free_blocks"] == 20
