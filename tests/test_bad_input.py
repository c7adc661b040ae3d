"""Bad input gets a ValueError naming the problem before any work starts; the engine keeps going."""

import json

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", 1.5), ("repetition_penalty", 1e-50), ("repetition_penalty", 1e9),
    ("logit_bias", {1: 1e39}), ("logit_bias", {1: -101}),
    ("logprobs", -2), ("prompt_logprobs", 1.5),
])
def test_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (1, 1.0, 1.0, 0, 0.0, 1.0, 16)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(stop="x").stop_strings == ["x"]


def test_values_that_would_overflow_float32_are_refused_or_clamped(llm):
    """top_p 1e-46 is 0 in float32, which once dropped every token (NaN probabilities, <pad>
    output): it is raised to the smallest normal float32, which keeps only the top token, as any
    tiny top_p means."""
    tiny = SamplingParams(temperature=0.8, top_p=1e-46, max_tokens=4, seed=1)
    assert 0 < tiny.top_p < 1e-37
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    out = llm.generate(prompt, tiny, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.fixture(scope="module")
def llm(llama_path):
    # 80 cached tokens < 100
    return LLM(llama_path, block_size=4, num_kv_blocks=20, max_model_len=100)


@pytest.mark.parametrize("prompt,message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 251]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -3]}, "outside the vocabulary"),
    ({"prompt_token_ids": list(range(100))}, "max_model_len"),
    ("some text", "no tokenizer"),
    ({"nothing": 1}, "prompt_token_ids"),
    (3.5, "prompt must be"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, use_tqdm=False)


def test_request_that_can_never_fit_in_the_cache(llm):
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": [1] * 50}, SamplingParams(max_tokens=90), use_tqdm=False)


def test_a_bad_prompt_in_a_batch_stops_the_batch_before_any_work(llm):
    good = {"prompt_token_ids": [1, 2, 3]}
    before = llm.engine.stats()
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": [999]}], use_tqdm=False)
    after = llm.engine.stats()
    assert after == before and not llm.engine.has_unfinished_requests()
    out = llm.generate(good, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5, "the engine still works"
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([good, good], [SamplingParams()], use_tqdm=False)


def test_duplicate_request_id(llm):
    eng = llm.engine
    eng.add_request("dup", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [3, 4])
    eng.abort_request("dup")
    eng.step()
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]


def test_missing_and_malformed_model_directories(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed"):
        LLM(str(tmp_path / "bad"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path / "noweights"))
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path / "gpt2"))


def test_missing_weights_are_named(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    src = checkpoints["llama"][0]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.gate_up_proj.weight"):
        LLM(str(tmp_path / "partial"))


@pytest.mark.parametrize("kwargs,name", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(attention_backend="cuda"), "attention_backend"), (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_engine_config_names_the_knob(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)


def test_dtype_and_max_model_len_checks(llama_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_path, dtype="float8", num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(llama_path, num_kv_blocks=8, max_model_len=100_000)
