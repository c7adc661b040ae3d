"""Gemma 3 (text) against transformers: a random tiny checkpoint with local (sliding, window shorter than most
prompts) and global layers, each kind rotating with its own base, the global one linearly scaled, norms that are
(1 + weight) and far from 1, the attention scale from query_pre_attn_scalar, GeGLU, and final-logit soft-capping."""

import statistics

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.quantization.int8 import quantize_per_channel
from tests.conftest import TINY, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], list(range(200, 250, 3)), [42] * 9]
MAX_NEW = 16
WINDOW = 6
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}


def build_gemma3(path, softcap: float | None = None, seed: int = 0, **overrides):
    """Save a random tiny Gemma 3; returns transformers' model (eager attention, eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = {**TINY, "head_dim": 16, "num_hidden_layers": 4, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
           "query_pre_attn_scalar": 24, "final_logit_softcapping": softcap, "rope_parameters": ROPE, **overrides}
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**cfg, attn_implementation="eager")).eval()
    with torch.no_grad():  # transformers starts the (1 + weight) norms at weight 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    model = build_gemma3(root / "g")
    return root / "g", model, [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


def generate(path, prompts=PROMPTS, max_tokens=MAX_NEW, params=None, **engine_args):
    llm = LLM(str(path), **{"dtype": "float32", **engine_args})
    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, llm.engine


def test_the_window_and_the_local_rope_matter(gemma, tmp_path):
    """The same weights with the window as wide as the context, or one rope base for all layers, decode
    otherwise: the checkpoint exercises both."""
    path, _, want = gemma
    wide = build_gemma3(tmp_path / "wide", sliding_window=512)
    one_base = build_gemma3(tmp_path / "one", rope_parameters={k: ROPE["full_attention"] for k in ROPE})
    assert [hf_greedy(wide, p, MAX_NEW) for p in PROMPTS] != want
    assert [hf_greedy(one_base, p, MAX_NEW) for p in PROMPTS] != want


@pytest.mark.parametrize("platform", ["cpu", "reference"])
@pytest.mark.parametrize("setting", [
    dict(block_size=4, num_kv_blocks=256, lazy_loading=True),  # each layer read when first run
    dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=7),  # chunks cross the window's edge
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32),  # preemption (recompute)
    dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, preemption_mode="swap", swap_space=0.01),
    dict(block_size=4, num_kv_blocks=160, speculative_model="[ngram]", num_speculative_tokens=3),  # drafts verified
])
def test_greedy_matches_transformers(gemma, setting, platform, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", platform)
    path, _, want = gemma
    outs, engine = generate(path, **setting)
    assert engine.runner.platform.name == platform
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert engine.kv.num_groups == 4, "3 local layers and 1 global: a group each, each with its own table"
    if setting["num_kv_blocks"] == 64:
        assert stats["num_preemptions"] > 0, "the setting was meant to force preemption"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_graph_batches_read_each_groups_tables(gemma, backend):
    """CUDA-graph decode batches (run eagerly here, padded, from the static buffers) give every group of layers its
    own slots and tables; the Triton kernels under the interpreter read them as the reference does (6 tokens:
    interpreted, each step takes seconds; greedy tokens are a prefix of the longer run's)."""
    from tests.test_cuda_graphs import attach_graphs

    path, _, want = gemma
    n = MAX_NEW if backend == "torch" else 6
    llm = LLM(str(path), dtype="float32", attention_backend=backend, block_size=4, num_kv_blocks=256)
    graphs = attach_graphs(llm, [2, 8], num_splits=2)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w[:n] for w in want]
    assert graphs.calls and graphs.group_tables.shape[0] == 4


def test_prefix_caching_reuses_blocks_and_keeps_the_tokens(gemma):
    path, _, want = gemma
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > 0


def logprobs_against(hf, outs) -> float:
    """The largest |logprob - transformers' log_softmax| over every prompt and output position."""
    worst = 0.0
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
        entries = [(t, out.prompt_logprobs[t]) for t in range(1, len(out.prompt_token_ids))]
        entries += [(len(out.prompt_token_ids) + i, lp) for i, lp in enumerate(out.outputs[0].logprobs)]
        for t, entry in entries:
            for token_id, lp in entry.items():
                worst = max(worst, abs(lp.logprob - float(ref[t - 1, token_id])))
    return worst


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_final_logit_softcapping_logprobs(tmp_path, softcap):
    """Capping is monotonic (greedy cannot see it): logprobs can. Cap 0.5 squeezes every logit into (-0.5, 0.5)."""
    hf = build_gemma3(tmp_path / "g", softcap=softcap)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    outs, _ = generate(tmp_path / "g", params=params, block_size=4, num_kv_blocks=256)
    assert logprobs_against(hf, outs) < 1e-4
    top = max(max(lp.logprob for lp in e.values()) for o in outs for e in o.outputs[0].logprobs)
    vocab_floor = -torch.log(torch.tensor(float(TINY["vocab_size"]))).item()
    assert (top < vocab_floor + 1.0) == (softcap is not None), top  # capped: near-uniform over the vocabulary


def test_tensor_parallel_2_equals_transformers(gemma):
    """Two ranks on gloo, 2 query heads and 1 KV head each (replicated norms, split vocabulary)."""
    path, hf, _ = gemma
    prompts = PROMPTS[1:4]
    with LLM(str(path), tensor_parallel_size=2, dtype="float32", block_size=4, num_kv_blocks=192,
             max_num_batched_tokens=9) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]


def test_bf16_logprobs_track_transformers_bf16(gemma):
    from transformers import AutoModelForCausalLM

    path, _, _ = gemma
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    outs, engine = generate(path, params=params, dtype="bfloat16", block_size=4, num_kv_blocks=256)
    assert engine.runner.dtype == torch.bfloat16
    # the tiny Llama's bf16 bound (test_cpu_bf16.py); measured here: 0.077 nats at worst
    assert logprobs_against(hf, outs) < 0.1


def test_int8_weights_equal_transformers_on_the_dequantized_weights(tmp_path):
    hf = build_gemma3(tmp_path / "g")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                q, s = quantize_per_channel(module.weight, torch.float32)
                module.weight.copy_(q.float() * s[:, None])
    outs, engine = generate(tmp_path / "g", quantization="int8", block_size=4, num_kv_blocks=256,
                            max_num_batched_tokens=7)
    assert engine.runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.int8
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_fp8_kv_cache_runs_gemma(gemma):
    """fp8 cache on both CPU platforms: the same tokens, prompt logprobs near the float cache's."""
    path, _, _ = gemma
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1)
    floats, _ = generate(path, params=params, block_size=4, num_kv_blocks=256)
    tokens = {}
    for platform in ("cpu", "reference"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MINIVLLM_PLATFORM", platform)
            outs, engine = generate(path, params=params, kv_cache_dtype="fp8", block_size=4, num_kv_blocks=256)
            assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
            tokens[platform] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu"] == tokens["reference"]
    gaps = [abs(a[t].logprob - b[t].logprob) for fo, eo in zip(floats, outs)
            for a, b in zip(fo.prompt_logprobs[1:], eo.prompt_logprobs[1:]) for t in a.keys() & b.keys()]
    assert statistics.median(gaps) < 0.3, statistics.median(gaps)


def test_float16_and_attention_softcapping_are_refused(gemma, tmp_path):
    path, _, _ = gemma
    with pytest.raises(ValueError, match="Gemma 3 does not run in float16.*float32"):
        LLM(str(path), dtype="float16", num_kv_blocks=64)
    build_gemma3(tmp_path / "capped", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping is not supported"):
        LLM(str(tmp_path / "capped"), dtype="float32", num_kv_blocks=64)


def test_every_layer_local_frees_blocks_behind_the_window_and_stays_equal(tmp_path):
    """A Gemma whose every layer slides is Mistral v0.1's case: blocks the window passed go back to the pool."""
    hf = build_gemma3(tmp_path / "local", layer_types=["sliding_attention"] * 4)
    outs, engine = generate(tmp_path / "local", block_size=4, num_kv_blocks=64, max_num_batched_tokens=7)
    assert engine.kv.window == WINDOW and engine.kv.num_groups == 1
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
