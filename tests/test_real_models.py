"""What real checkpoints bring that our own fixtures never had, and the names vLLM users type (issue 13).

The main fixture breaks our assumptions the way real checkpoints do: its embedding matrix is padded past the
tokenizer (1,920 rows for the embedded model's 1,834-token tokenizer, like Qwen2's 151,936 for 151,646), and
the padded rows are made likely, so the model really samples ids that have no token string.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import DEFAULT_MODEL
from minivllm.sampling_params import RequestOutputKind
from tests.conftest import build_checkpoint, hf_greedy

TOKENIZER_SIZE = 1834  # the embedded model's tokenizer
PADDED_VOCAB = 1920  # the next multiple of 64 up, as many real models pad


def copy_tokenizer(path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A random Llama whose vocabulary is larger than its tokenizer's, and which often picks the extra ids."""
    path = tmp_path_factory.mktemp("padded") / "model"
    model = build_checkpoint("llama", path, vocab_size=PADDED_VOCAB, max_position_embeddings=512)
    with torch.no_grad():
        model.lm_head.weight[TOKENIZER_SIZE:] *= 3.0  # the padded rows win the argmax now and then
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path, model


def test_ids_without_a_token_string_decode_to_nothing(padded):
    path, model = padded
    llm = LLM(path, block_size=8, num_kv_blocks=128)
    prompts = ["Once upon a time", "Tom had a red ball", "The sun"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert any(t >= TOKENIZER_SIZE for t in ids), "the fixture must really produce ids the tokenizer lacks"
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, tok(prompt).input_ids, 24), "still transformers' tokens"
        known = [t for t in out.outputs[0].token_ids if t < TOKENIZER_SIZE]
        assert out.outputs[0].text == tok.decode(known, skip_special_tokens=True)
    # the same text on every path: streamed step by step, stop strings (also token by token), sampled, DELTA
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["@@@"]),
                   SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)):
        streamed = {}
        for i, p in enumerate(prompts):
            llm.engine.add_request(str(i), p, params)
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].text \
                    if params.output_kind is RequestOutputKind.DELTA else out.outputs[0].text
        assert [streamed[str(i)] for i in range(3)] == [o.outputs[0].text for o in outs]
    hot = llm.generate(prompts * 4, SamplingParams(temperature=1.5, max_tokens=24, seed=1), use_tqdm=False)
    assert all(isinstance(o.outputs[0].text, str) for o in hot)


def test_padded_vocabulary_through_the_server(padded):
    import openai

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import build_app
    from tests.test_server import ServerThread

    path, _ = padded
    engine = LLMEngine(EngineConfig(path, block_size=8, num_kv_blocks=128, trace_steps=0))
    server = ServerThread(build_app(engine, "padded"))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=30)
        full = client.completions.create(model="padded", prompt="Once upon a time", max_tokens=24, temperature=0)
        chunks = client.completions.create(model="padded", prompt="Once upon a time", max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert full.usage.completion_tokens == 24
    finally:
        server.stop()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def with_generation_config(src, dst, **config):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def test_eos_list_from_generation_config(padded, tmp_path):
    path, _ = padded
    plain = LLM(path, block_size=8, num_kv_blocks=64).generate("Once upon a time",
                                                               SamplingParams(temperature=0, max_tokens=12),
                                                               use_tqdm=False)[0].outputs[0].token_ids
    stop_at = plain[5]
    first = plain.index(stop_at)  # the first time the model says it
    llm = LLM(with_generation_config(path, tmp_path / "eos", eos_token_id=[7, stop_at]), block_size=8,
              num_kv_blocks=64)
    assert stop_at in llm.engine.eos_token_ids and 7 in llm.engine.eos_token_ids
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop"
    ignored = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == plain


def test_generation_config_sampling_defaults(padded, tmp_path):
    path, _ = padded
    gen_path = with_generation_config(path, tmp_path / "gen", temperature=1e-9, top_k=3, max_new_tokens=5)
    llm = LLM(gen_path, block_size=8, num_kv_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 3, 5), "1e-9 is below the epsilon"
    out = llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.token_ids == greedy.outputs[0].token_ids
    vllm_defaults = LLM(gen_path, block_size=8, num_kv_blocks=64, generation_config="vllm")
    assert vllm_defaults.get_default_sampling_params().max_tokens == 16


def test_a_sliding_window_does_not_cap_the_length(tmp_path):
    """Sliding-window attention is run, not refused: max_model_len is the model's positions, whatever its window."""
    path = tmp_path / "mistral"
    import transformers as tf

    from tests.conftest import TINY

    tf.MistralForCausalLM(tf.MistralConfig(**{**TINY, "sliding_window": 32})).save_pretrained(path)
    assert LLM(path, block_size=4, num_kv_blocks=64).engine.config.max_model_len == 256
    assert LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64).engine.config.max_model_len == 64


def test_chunking_off_with_a_budget_below_max_model_len_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(max_num_batched_tokens=16, enable_chunked_prefill=False)
    llm = LLM(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)  # fits: fine
    out = llm.generate("Hi, my name is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def tiny():
    return LLM(block_size=16, num_kv_blocks=64)


def test_stop_token_text_is_left_out_unless_asked_for(tiny):
    tok = tiny.get_tokenizer()
    base = tiny.generate("Hi, my name is", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    i = next(i for i in range(2, 10) if tok.decode(ids[i : i + 1]).strip() and ids[i] not in ids[:i])
    for stream in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[i]],
                                    include_stop_str_in_output=include, output_kind=stream)
            tiny.engine.add_request("s", "Hi, my name is", params)
            while tiny.engine.has_unfinished_requests():
                outs = tiny.engine.step()
            out = outs[-1].outputs[0]
            assert out.token_ids == ids[: i + 1] and out.stop_reason == ids[i]
            assert out.text == tok.decode(ids[: i + 1 if include else i], skip_special_tokens=True)
    stop = tok.decode(ids[i : i + 1])
    kept = tiny.generate("Hi, my name is", SamplingParams(temperature=0, max_tokens=10, stop=[stop],
                                                          include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text.endswith(stop) and kept.outputs[0].stop_reason == stop


def test_tiny_temperature_is_greedy_and_non_finite_values_are_refused(tiny):
    greedy = tiny.generate("Hello there", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tiny_t = tiny.generate("Hello there", SamplingParams(temperature=1e-39, max_tokens=8), use_tqdm=False)[0]
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids
    for field in ("temperature", "top_p", "min_p", "repetition_penalty"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: bad})


def test_abort_takes_one_id_or_a_list(tiny):
    eng = tiny.engine
    for rid in "abc":
        eng.add_request(rid, "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request(["a", "b"])
    eng.abort_request("c")
    eng.abort_request(["missing"])
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks and not eng.has_unfinished_requests()


def test_metrics_cached_tokens_and_chat_prompt(tiny):
    prompt = "Once upon a time, there was a little girl who lived in a village near the forest. " * 2
    out = tiny.generate(prompt, SamplingParams(n=3, max_tokens=4, seed=0), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert out.num_cached_tokens >= 16, "the second and third samples reuse the first one's prompt blocks"
    chat = tiny.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    rendered, _ = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert chat.prompt == rendered and chat.prompt.endswith("<|assistant|>\n")


def test_vllm_names(tiny, tmp_path):
    from minivllm.config import DEFAULT_DRAFT_MODEL

    assert tiny.llm_engine is tiny.engine
    hf_tok = tiny.get_tokenizer()
    assert hf_tok.encode("Hello") == tiny.tokenizer.encode("Hello")
    convo = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once"}]
    cont = tiny.chat(convo, SamplingParams(max_tokens=3), add_generation_prompt=False, continue_final_message=True,
                     use_tqdm=False)[0]
    assert cont.prompt.endswith("Once"), "the reply continues the assistant's unfinished message"
    with pytest.raises(ValueError, match="continue_final_message"):
        tiny.chat(convo, continue_final_message=True)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    reference = tiny.generate("Hi, my name is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    for spec in ({"model": str(DEFAULT_DRAFT_MODEL), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}):
        llm = LLM(speculative_config=spec, num_kv_blocks=64, trust_remote_code=True, tensor_parallel_size=1)
        assert llm.generate("Hi, my name is", greedy, use_tqdm=False)[0].outputs[0].token_ids == reference
        assert llm.engine.runner.proposer is not None
    for kwargs, message in [({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                            ({"quantization": "awq"}, "quantization"), ({"no_such_thing": 1}, "no_such_thing"),
                            ({"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}}, "eagle")]:
        with pytest.raises(ValueError, match=message):
            LLM(num_kv_blocks=64, **kwargs)


def test_delta_outputs_add_up_to_the_cumulative_ones(tiny):
    eng = tiny.engine
    runs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        eng.add_request(kind.value, "Hello there", SamplingParams(temperature=0, max_tokens=20, n=2,
                                                                  output_kind=kind, stop=["zzz"]))
        text, ids = ["", ""], [[], []]
        while eng.has_unfinished_requests():
            for out in eng.step():
                for c in out.outputs:
                    if kind is RequestOutputKind.DELTA:
                        text[c.index] += c.text
                        ids[c.index] += c.token_ids
                    else:
                        text[c.index], ids[c.index] = c.text, c.token_ids
        runs[kind] = (text, ids)
    assert runs[RequestOutputKind.DELTA] == runs[RequestOutputKind.CUMULATIVE]


def test_model_by_hub_id_from_the_cache(tmp_path, llama_path, monkeypatch):
    from tests.test_hub import add_to_hf_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    add_to_hf_cache(llama_path, cache, "tiny-org/tiny-llama")
    by_id = LLM("tiny-org/tiny-llama", download_dir=cache, block_size=4, num_kv_blocks=64)
    local = LLM(llama_path, block_size=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    assert by_id.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        local.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert by_id.engine.config.served_model_name == "tiny-org/tiny-llama"
    with pytest.raises(ValueError, match="tiny-org/missing"):
        LLM("tiny-org/missing", download_dir=cache)
