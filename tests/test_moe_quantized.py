"""Quantized mixtures of experts: int8 weight-only experts (quantized at load, one scale per output row of each
expert, by the engine's quantizer or a learner's hook) and the FP8 KV cache, which is attention's
side of the model and should not care that the MLP is sparse."""

import statistics

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.moe_layer import FusedExperts
from minivllm.quantization.int8 import quantize_per_channel
from tests.conftest import hf_greedy
from tests.test_moe_families import PROMPTS, E, build_moe_checkpoint

MAX_NEW = 16


def dequantize_like_int8(hf, quantize=None) -> None:
    """transformers' model with every weight int8 quantizes replaced by q * s: the router, embeddings and LM head
    stay float (as in the engine), each expert's matrices are quantized on their own (`quantize`: a learner's
    EngineHooks.int8_quantize instead of the engine's)."""
    quantize = quantize or (lambda w: quantize_per_channel(w, torch.float32))
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith(("gate", "lm_head")):
                q, s = quantize(module.weight)
                module.weight.copy_(q.float() * s[:, None])
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
                for stacked in (module.gate_up_proj, module.down_proj):
                    for expert in stacked:
                        q, s = quantize(expert)
                        expert.copy_(q.float() * s[:, None])


@pytest.mark.parametrize("platform", ["cpu", "reference"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])  # qwen2_moe: its shared expert is int8 too
def test_int8_experts_equal_transformers_on_the_dequantized_weights(tmp_path, kind, platform, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", platform)
    hf = build_moe_checkpoint(kind, tmp_path / kind)
    dequantize_like_int8(hf)
    llm = LLM(str(tmp_path / kind), dtype="float32", quantization="int8", num_kv_blocks=64,
              max_num_batched_tokens=7)  # chunked prefill too
    experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.int8
    assert experts.gate_up_scale.shape == (E, 80) and experts.down_scale.shape == (E, 64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_the_learners_int8_hook_quantizes_the_experts(tmp_path):
    """EngineHooks.int8_quantize reaches every expert block, not only the dense layers: a hook that keeps 15 levels
    a side (the engine keeps 127) is called once per expert matrix, its values are what the experts hold, and
    greedy tokens follow transformers run on the hook's dequantized weights."""
    from minivllm.hooks import EngineHooks

    calls = []

    def coarse(w):
        calls.append(tuple(w.shape))
        scale = (w.float().abs().amax(dim=1) / 15).clamp(min=1e-8)
        return torch.round(w.float() / scale[:, None]).clamp(-15, 15).to(torch.int8), scale

    hf = build_moe_checkpoint("mixtral", tmp_path / "m")
    dequantize_like_int8(hf, coarse)
    calls.clear()
    llm = LLM(str(tmp_path / "m"), dtype="float32", quantization="int8", num_kv_blocks=64,
              hooks=EngineHooks(int8_quantize=coarse))
    all_experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert calls.count((80, 64)) == calls.count((64, 40)) == E * len(all_experts)  # gate_up and down of each
    for experts in all_experts:
        assert experts.gate_up_proj.abs().max() == experts.down_proj.abs().max() == 15
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_int8_experts_hold_a_quarter_of_their_fp32_bytes(tmp_path):
    build_moe_checkpoint("mixtral", tmp_path / "m")
    sizes = {}
    for quant in (None, "int8"):
        experts = next(m for m in LLM(str(tmp_path / "m"), dtype="float32", quantization=quant,
                                      num_kv_blocks=16).engine.runner.model.modules() if isinstance(m, FusedExperts))
        sizes[quant] = sum(t.numel() * t.element_size() for t in [*experts.parameters(), *experts.buffers()])
    assert sizes["int8"] / sizes[None] <= 0.27, sizes  # 1 byte per weight, plus one fp32 scale per row


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_fp8_kv_cache_runs_a_moe_model(tmp_path, kind):
    """An fp8 cache under a MoE model: the cpu and reference platforms give the same tokens, and prompt logprobs
    (teacher forced) stay near the float cache's. Measured on these random tiny checkpoints: median |dlogprob|
    0.117 (Mixtral) and 0.115 (Qwen3-MoE), against 0.070 for the dense tiny Llama: random weights make every
    model here sensitive; a cache read with the wrong format or scale lands at chance, nats away."""
    build_moe_checkpoint(kind, tmp_path / kind)
    path = str(tmp_path / kind)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    float_run = LLM(path, dtype="float32", num_kv_blocks=64).generate(inputs, params, use_tqdm=False)
    tokens = {}
    for platform in ("cpu", "reference"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MINIVLLM_PLATFORM", platform)
            llm = LLM(path, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)
            assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
            outs = llm.generate(inputs, params, use_tqdm=False)
        tokens[platform] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu"] == tokens["reference"]
    diffs = [abs(a[t].logprob - b[t].logprob) for fa, fb in zip(float_run, outs)
             for a, b, t in zip(fa.prompt_logprobs[1:], fb.prompt_logprobs[1:], fa.prompt_token_ids[1:])]
    assert statistics.median(diffs) < 0.25, statistics.median(diffs)
