"""vLLM's offline APIs used the way its examples/offline_inference scripts use them (our own code,
on the embedded model): get_metrics, reset_prefix_cache, start/stop_profile, AsyncLLM streaming, the
OpenAI batch runner, and the import paths those scripts use."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time",
           "The future of AI is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=96)


def test_vllm_import_paths_resolve():
    from minivllm.config import EngineConfig, VllmConfig
    from minivllm.distributed import cleanup_dist_env_and_memory
    from minivllm.inputs import TokensPrompt
    from minivllm.logger import init_logger
    from minivllm.sampling.logits_processor import (
        AdapterLogitsProcessor,
        LogitsProcessor,
        process_dict_updates,
    )
    from minivllm.server.async_llm import AsyncLLM
    from minivllm.v1.engine.async_llm import AsyncLLM as AsyncLLM_
    from minivllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector  # noqa: F401
    from minivllm.v1.sample.logits_processor import AdapterLogitsProcessor as A
    from minivllm.v1.sample.logits_processor import LogitsProcessor as L
    from minivllm.v1.sample.logits_processor.builtin import process_dict_updates as p

    assert (AsyncLLM_, A, L, p, VllmConfig) == (AsyncLLM, AdapterLogitsProcessor, LogitsProcessor,
                                               process_dict_updates, EngineConfig)
    assert init_logger(__name__).name == f"minivllm.{__name__}"
    assert init_logger("minivllm.x").name == "minivllm.x"
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    cleanup_dist_env_and_memory()


def test_get_metrics_counts_what_generate_did(llm):
    """The metrics.py pattern: generate, then walk get_metrics() by type."""
    from minivllm.v1.metrics.reader import Counter, Gauge, Histogram

    def by_name():
        out = {}
        for m in llm.get_metrics():
            out.setdefault(m.name, []).append(m)
        return out

    before = by_name()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=0),
                        use_tqdm=False)
    after = by_name()
    assert all(name.startswith("vllm:") for name in after)

    def counter(metrics, name, **labels):
        [m] = [m for m in metrics.get(name, []) if labels.items() <= m.labels.items()]
        assert isinstance(m, Counter)
        return m.value

    made = sum(len(o.outputs[0].token_ids) for o in outs)
    assert (counter(after, "vllm:generation_tokens") - counter(before,
                                                               "vllm:generation_tokens") == made)
    assert counter(after, "vllm:prompt_tokens") - counter(before, "vllm:prompt_tokens") == sum(
        len(o.prompt_token_ids) for o in outs)
    finished = sum(counter(after, "vllm:request_success",
                           finished_reason=r) for r in ("stop", "length"))
    assert finished - sum(counter(before, "vllm:request_success", finished_reason=r)
                          for r in ("stop", "length")) == len(PROMPTS)
    [e2e] = after["vllm:e2e_request_latency_seconds"]
    assert (isinstance(e2e, Histogram) and e2e.count >= len(PROMPTS)
            and e2e.buckets["+Inf"] == e2e.count)
    assert list(e2e.buckets.values()) == sorted(e2e.buckets.values()), "buckets are cumulative"
    [running] = after["vllm:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0
    assert after["vllm:kv_cache_usage_perc"][0].value == 0, "every block is back"


def test_spec_decode_metrics_are_a_vector_per_position():
    """The spec_decode.py pattern: drafts, draft tokens, accepted tokens and the per-position Vector
    agree."""
    from minivllm.v1.metrics.reader import Counter, Vector

    llm = LLM(num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    llm.generate(["one two three one two three one two", "a b a b a b a b"],
                 SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts, proposed = metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_draft_tokens"]
    accepted, per_pos = metrics["vllm:spec_decode_num_accepted_tokens"], metrics[
        "vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(drafts, Counter) and isinstance(per_pos, Vector)
    stats = llm.engine.stats()
    assert (drafts.value, proposed.value, accepted.value) == (stats["spec_num_steps"],
                                                              stats["spec_num_proposed"],
                                                              stats["spec_num_accepted"])
    assert drafts.value > 0 and sum(per_pos.values) == accepted.value and len(per_pos.values) == 3
    assert (per_pos.values == sorted(per_pos.values,
                                     reverse=True)), "a later position is accepted only after earlier"


def test_reset_prefix_cache_between_runs(llm):
    """The automatic_prefix_caching.py pattern: a shared prefix hits; after a reset it is computed
    again."""
    prefix = "You are a helpful assistant who answers in one short sentence about geography. " * 3
    prompts = [prefix + q for q in ("Where is Paris?", "Where is Rome?")]
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(prompts[0], params, use_tqdm=False)[0]
    warm = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert first.finished


def test_reset_prefix_cache_refuses_while_blocks_are_held_unless_told():
    """The llm_engine_reset_kv.py pattern: reset in the middle of a run, with
    reset_running_requests=True."""
    engine = LLMEngine(LLM(num_kv_blocks=64).engine.config)
    prompt = "A robot may not injure a human being " * 4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(num_kv_blocks=64).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("0", prompt, params)
    engine.step()
    assert engine.kv.pool.cached, "the prompt's full blocks are named"
    assert (engine.reset_prefix_cache() is False
            and engine.kv.pool.cached), "refused: a request holds blocks"
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert not any(b.block_hash for b in engine.kv.pool.blocks)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == ref, "the running request is unaffected"
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_profile_writes_a_chrome_trace(llm, tmp_path, monkeypatch):
    """The simple_profiling.py pattern: the directory comes from vLLM's environment variable."""
    monkeypatch.delenv("MINIVLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    llm.start_profile()
    with pytest.raises(ValueError, match="twice"):
        llm.start_profile()
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3), use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path / "prof"
    trace = json.loads(path.read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names), "the model's operators are in the trace"
    with pytest.raises(ValueError, match="without start_profile"):
        llm.stop_profile()


def test_async_llm_streams_deltas_and_runs_requests_together():
    """The async_llm_streaming.py pattern (DELTA outputs, `async for`, shutdown()), with several
    requests at once: the deltas add up to what a cumulative run produces, and the requests shared
    steps."""
    from minivllm.config import VllmConfig
    from minivllm.sampling_params import RequestOutputKind
    from minivllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_vllm_config(VllmConfig(num_kv_blocks=96))
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def stream(prompt: str, rid: str):
        text, tokens, n_outputs = "", [], 0
        async for out in engine.generate(request_id=rid, prompt=prompt, sampling_params=params):
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            n_outputs += 1
            if out.finished:
                break
        return text, tokens, n_outputs

    async def main():
        try:
            return await asyncio.gather(*(stream(p, f"r{i}") for i, p in enumerate(PROMPTS)))
        finally:
            engine.shutdown()

    results = asyncio.run(main())
    ref = LLM(num_kv_blocks=96).generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.8,
                                                                 top_p=0.95, seed=42,
                                                                 ignore_eos=True), use_tqdm=False)
    for (text, tokens, n_outputs), out in zip(results, ref):
        assert tokens == out.outputs[0].token_ids and text == out.outputs[0].text
        assert n_outputs > 1, "streamed, not one final output"
    stats = engine.engine.stats()
    assert stats["num_steps"] < sum(len(t) for _, t, _ in results), "requests shared steps"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_async_llm_abort_and_bad_input():
    from minivllm.server.async_llm import AsyncLLM

    engine = AsyncLLM(LLM(num_kv_blocks=64).engine)

    async def main():
        with pytest.raises(ValueError, match="request_id"):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([1] * 10_000, SamplingParams(max_tokens=2),
                                           request_id="big"):
                pass
        seen = []

        async def long():
            async for out in engine.generate("count", SamplingParams(max_tokens=200, ignore_eos=True),
                                             request_id="long"):
                seen.append(out)

        task = asyncio.create_task(long())
        while not seen:
            await asyncio.sleep(0.01)
        await engine.abort("long")
        await asyncio.wait_for(task, 30)
        assert len(seen[-1].outputs[0].token_ids) < 200
        for _ in range(600):  # the owner frees the blocks at its next step
            stats = engine.engine.stats()
            if stats["num_free_blocks"] == stats["num_total_blocks"]:
                break
            await asyncio.sleep(0.05)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        engine.shutdown()
        assert not engine.is_running

    asyncio.run(main())


def _batch_lines(model: str) -> list[str]:
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "Say hello"}],
                  "max_tokens": 5, "temperature": 0}},
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                  "temperature": 0}},
        {"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
         "body": {"model": "nope", "prompt": "x", "max_tokens": 2}},
        {"custom_id": "bad-field", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "x", "max_tokens": -3}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    return [json.dumps(x) for x in lines] + ["{not json"]


def test_run_batch_answers_each_line_in_order(llm):
    from minivllm.entrypoints.openai.run_batch import run_batch

    name = llm.engine.config.served_model_name
    results = asyncio.run(run_batch(llm.engine, _batch_lines(name), name))
    assert [r["custom_id"] for r in results] == ["chat-1", "cmpl-1", "bad-model", "bad-field",
                                                 "bad-url", None]
    chat, cmpl, bad_model, bad_field, bad_url, not_json = results
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["usage"]["completion_tokens"] <= 5
    ref = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert cmpl["response"]["body"]["choices"][0]["text"] == ref.outputs[0].text
    assert bad_model["response"]["status_code"] == 404 and "nope" in bad_model["error"]["message"]
    assert (bad_field["response"]["status_code"] == 400
            and "max_tokens" in json.dumps(bad_field["error"]))
    assert bad_url["response"] is None and "/v1/embeddings" in bad_url["error"]["message"]
    assert not_json["response"] is None and "JSON" in not_json["error"]["message"]


def test_run_batch_command_line(tmp_path):
    """`python -m minivllm.entrypoints.openai.run_batch -i ... -o ...` with vLLM's engine flags."""
    pytest.importorskip("minivllm.engine.arg_utils",
                        reason="EngineArgs comes with the CLI half of issue 27")
    from minivllm.config import DEFAULT_MODEL

    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(_batch_lines(str(DEFAULT_MODEL))[:2]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.openai.run_batch", "-i",
                           str(src),
                           "-o", str(dst), "--model", str(DEFAULT_MODEL), "--max-num-seqs", "4"],
                          capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat-1", "cmpl-1"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_best_of_returns_the_likeliest_n_of_best_of_samples(llm):
    """The llm_engine_example.py pattern (n=2, best_of=5, via add_request/step): the two returned
    are the two likeliest of five samples. Oracle: the same five samples drawn as n=5 (sample i is
    seeded seed + i)."""
    prompt, kw = "What is the meaning of life?", dict(temperature=0.8, top_p=0.95,
                                                      frequency_penalty=0.1,
                                                       max_tokens=8, seed=3)
    engine = llm.engine
    engine.add_request("best", prompt, SamplingParams(n=2, best_of=5, **kw))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "best"]
    assert len(outputs) == 1 and outputs[0].finished, "reported once, when the ranking is known"
    best = outputs[0].outputs
    five = llm.generate(prompt, SamplingParams(n=5, logprobs=0, **kw), use_tqdm=False)[0].outputs
    ranked = sorted(five, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert ([c.index for c in best] == [0, 1]
            and best[0].cumulative_logprob >= best[1].cumulative_logprob)
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob
                                                                  for c in ranked])
    assert best[0].logprobs is None, "logprobs were not asked for: only used for the ranking"
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
