"""The LLMEngine step API, aborts, stats and the step trace."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.journey import format_journey


@pytest.fixture
def llm(llama_path):
    """A fresh engine for each test: request ids, free blocks and the trace never carry over between tests."""
    return LLM(llama_path, block_size=4, num_kv_blocks=48, max_num_batched_tokens=16)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_step_api_streams_cumulative_outputs(llm):
    eng = llm.engine
    eng.add_request("a", [1, 2, 3, 4, 5], greedy(6))
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(list(out.outputs[0].token_ids))
    assert [len(s) for s in seen] == [1, 2, 3, 4, 5, 6]
    assert all(s == seen[-1][: len(s)] for s in seen)
    assert eng.stats()["num_running"] == eng.stats()["num_waiting"] == 0


def test_abort_frees_blocks_and_reports_abort(llm):
    eng = llm.engine
    eng.add_request("long", list(range(1, 30)), greedy(40))
    eng.add_request("other", [7, 8, 9], greedy(5))
    for _ in range(3):
        eng.step()
    assert eng.stats()["num_free_blocks"] < eng.stats()["num_total_blocks"]
    eng.abort_request("long")
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs["long"].outputs[0].finish_reason == "abort" and outs["long"].finished
    assert outs["other"].outputs[0].finish_reason == "length"
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    eng.abort_request("unknown-id")  # harmless


def test_stop_token_ids_and_max_model_len(llm, checkpoints):
    ref = llm.generate({"prompt_token_ids": [3, 4, 5]}, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    stop_at = ref[4]
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, greedy(10, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == ref[: ref.index(stop_at) + 1]
    short = LLM(checkpoints["llama"][0], block_size=4, num_kv_blocks=48, max_model_len=8)
    out = short.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_trace_records_the_journey(llama_path):
    llm = LLM(llama_path, block_size=4, num_kv_blocks=48, max_num_batched_tokens=16)
    eng = llm.engine
    llm.generate([{"prompt_token_ids": list(range(1, 22))}, {"prompt_token_ids": [5, 6]}], greedy(3),
                 use_tqdm=False)
    steps = list(eng.trace)
    assert [s.step for s in steps] == list(range(len(steps)))
    # budget 16: the 21-token prompt is chunked 16 + 5; the short one waits for room in step 2
    assert [(e.num_tokens, e.kind) for e in steps[0].scheduled] == [(16, "prefill")]
    assert steps[0].allocated["0"] == steps[0].block_tables["0"] and len(steps[0].allocated["0"]) == 4
    assert steps[0].scheduled[0].sampled_token is None and steps[0].waiting == ["1"]
    assert [(e.request_id, e.kind) for e in steps[1].scheduled] == [("0", "prefill"), ("1", "prefill")]
    assert steps[1].scheduled[0].sampled_token is not None
    assert any(e.kind == "decode" for e in steps[2].scheduled)
    freed = {rid: blocks for s in steps for rid, blocks in s.freed.items()}
    assert sorted(freed["0"]) == sorted(steps[1].block_tables["0"])
    assert steps[-1].num_free_blocks == steps[-1].num_total_blocks
    assert sum(len(s.finished) for s in steps) == 2
    text = format_journey(steps)
    assert "prefill" in text and "freed" in text


def test_generate_accepts_token_list_and_timings(llm):
    out = llm.generate([1, 2, 3], greedy(2), use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == [1, 2, 3]
    m = out[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time and m.time_to_first_token >= 0


def test_tqdm_bar_runs(llm, capsys):
    llm.generate([[1, 2], [3, 4]], greedy(3), use_tqdm=True)
    assert "tok/s" in capsys.readouterr().err


def test_vllm_cpu_kvcache_space_sizes_the_cpu_cache(llama_path, monkeypatch):
    """vLLM's CPU knob (GiB) sizes the cache where kv_cache_memory_bytes is not given, as a vLLM user
    running `vllm serve` on a CPU sets it; an explicit budget wins, and a bad value is named."""
    from minivllm.config import EngineConfig
    from minivllm.core.kv_sizing import DEFAULT_CPU_KV_CACHE_BYTES

    base = dict(model=llama_path, max_num_seqs=256, max_model_len=256)
    assert EngineConfig(**base).cpu_kv_cache_bytes == DEFAULT_CPU_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert EngineConfig(**base).cpu_kv_cache_bytes == 3 << 30
    assert EngineConfig(**base, kv_cache_memory_bytes=1 << 20).cpu_kv_cache_bytes == 1 << 20
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "-1")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        _ = EngineConfig(**base).cpu_kv_cache_bytes


def test_cache_takes_no_more_blocks_than_sequences_can_fill(llama_path):
    """A 1 GiB budget would hold thousands of this tiny model's blocks; 4 sequences of 256 tokens fill 64."""
    llm = LLM(llama_path, kv_cache_memory_bytes=2**30, max_num_seqs=4, block_size=16)
    assert llm.engine.runner.num_blocks == 4 * 256 // 16
    assert llm.engine.config.max_model_len == 256
    explicit = LLM(llama_path, num_kv_blocks=500, max_num_seqs=4)  # an explicit count is taken as given
    assert explicit.engine.runner.num_blocks == 500
