"""minivllm's greedy tokens equal transformers' greedy tokens, whatever the scheduler does in between."""

import pytest

from minivllm import LLM, SamplingParams
from tests.conftest import build_checkpoint, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], list(range(200, 250, 3)), [42] * 9]
MAX_NEW = 24


def run(path, prompts=PROMPTS, max_tokens=MAX_NEW, **engine_args):
    llm = LLM(path, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: [hf_greedy(model, p, MAX_NEW) for p in PROMPTS] for kind, (_, model) in checkpoints.items()}


@pytest.mark.parametrize("platform", ["cpu", "reference"])  # the C++ fast paths, and the readable torch code
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("setting", [
    dict(block_size=16, num_kv_blocks=64),  # plenty of room: one prefill step, then decodes
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=7),  # chunked prefill in every prompt
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32),  # too few blocks: preemption
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=5, max_num_seqs=3),  # both, and a seq cap
])
def test_greedy_matches_transformers(checkpoints, references, kind, setting, platform, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", platform)
    tokens, engine = run(checkpoints[kind][0], **setting)
    assert engine.runner.platform.name == platform
    assert tokens == references[kind]
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if setting["num_kv_blocks"] == 16:
        assert stats["num_preemptions"] > 0, "the setting was meant to force preemption"


def test_preemption_with_prefix_caching_off(checkpoints, references):
    tokens, engine = run(checkpoints["llama"][0], block_size=4, num_kv_blocks=16, enable_prefix_caching=False)
    assert tokens == references["llama"]
    assert engine.stats()["num_preemptions"] > 0


def test_llama3_rope_scaling_and_mistral(tmp_path):
    """Checkpoints whose config has llama3 rope scaling, and a Mistral (same decoder, its own model_type)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = build_checkpoint("llama", tmp_path / "l3", rope_scaling=scaling, rope_theta=500000.0)
    prompts = [list(range(3, 60)), [5, 6, 7]]
    tokens, _ = run(tmp_path / "l3", prompts, block_size=8, num_kv_blocks=64)
    assert tokens == [hf_greedy(model, p, MAX_NEW) for p in prompts]

    import torch
    import transformers as tf

    from tests.conftest import TINY

    torch.manual_seed(1)
    mistral = tf.MistralForCausalLM(tf.MistralConfig(**TINY, sliding_window=None)).eval()
    mistral.save_pretrained(tmp_path / "mistral")
    tokens, _ = run(tmp_path / "mistral", prompts, block_size=8, num_kv_blocks=64)
    assert tokens == [hf_greedy(mistral, p, MAX_NEW) for p in prompts]


def test_sharded_checkpoint_loads(tmp_path, checkpoints):
    """A checkpoint split over several safetensors files gives the same tokens."""
    _, model = checkpoints["llama"]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    tokens, _ = run(tmp_path / "sharded", PROMPTS[:2], block_size=8, num_kv_blocks=64)
    assert tokens == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral whose window (6) is shorter than most prompts, and a Qwen2 whose layers from max_window_layers on
    slide: {kind: (path, hf model)}."""
    import torch
    import transformers as tf

    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("windowed")
    torch.manual_seed(2)
    mistral = tf.MistralForCausalLM(tf.MistralConfig(**TINY, sliding_window=6)).eval()
    mistral.save_pretrained(root / "mistral")
    qwen2 = build_checkpoint("qwen2", root / "qwen2", sliding_window=6, use_sliding_window=True, max_window_layers=1)
    assert qwen2.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    unwindowed = tf.MistralForCausalLM(tf.MistralConfig(**TINY, sliding_window=None)).eval()
    unwindowed.load_state_dict(mistral.state_dict())
    assert hf_greedy(unwindowed, PROMPTS[1], MAX_NEW) != hf_greedy(mistral, PROMPTS[1], MAX_NEW), "window too wide"
    return {"mistral": (root / "mistral", mistral), "qwen2": (root / "qwen2", qwen2)}


@pytest.mark.parametrize("platform", ["cpu", "reference"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("setting", [
    dict(block_size=4, num_kv_blocks=64),
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=7),  # chunks cross the window's edge
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32),  # preemption
    dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, preemption_mode="swap", swap_space=0.01),
    dict(block_size=4, num_kv_blocks=40, speculative_model="[ngram]", num_speculative_tokens=3),  # drafts verified
])
def test_sliding_window_matches_transformers(windowed, kind, setting, platform, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", platform)
    path, model = windowed[kind]
    groups = 3 if kind == "qwen2" else 1  # its full layer and its two sliding layers: a table each
    tokens, engine = run(path, **{**setting, "num_kv_blocks": setting["num_kv_blocks"] * groups})
    assert tokens == [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    assert engine.kv.num_groups == groups
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
