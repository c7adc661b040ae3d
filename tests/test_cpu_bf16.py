"""bf16 on CPU: dtype="auto" picks it where the CPU has native bf16, and its outputs track transformers' in bf16.

The check for bf16 (documented in bench/RESULTS.md): both engines compute in bf16 with fp32 accumulation, but
not in the same order (fused q/k/v and gate/up matmuls, oneDNN's packed weights, a different attention kernel),
so equality is not expected. At every prompt and completion position, the logprob of the token there and of
the top 3 must be within LOGPROB_TOL of transformers' bf16 log-softmax. The fp32 suite asserts 1e-4. This check
caught a real bug while it was written (a decode group sized by the wrong request's context) that fp32 greedy
tokens on other prompts had not.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.platforms.cpu import onednn_applies
from minivllm.platforms.cpu_hardware import CpuThreadSizer, cpu_has_native_bf16, default_cpu_dtype
from minivllm.quantization.cpu_unquantized import packed_linear, reorder_weight
from minivllm.quantization.unquantized import plain_weight

LOGPROB_TOL = 0.1  # nats; measured: up to 0.078 (llama) and 0.064 (qwen3); transformers' own bf16 vs fp32: 0.22
PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [100, 3], list(range(200, 250, 3))]


def test_auto_is_bf16_exactly_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_DTYPE", raising=False)
    assert default_cpu_dtype() == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    monkeypatch.setenv("MINIVLLM_CPU_DTYPE", "float32")
    assert default_cpu_dtype() == torch.float32
    monkeypatch.setenv("MINIVLLM_CPU_DTYPE", "float16")  # what a T4 learner gets, run on CPU
    assert default_cpu_dtype() == torch.float16
    monkeypatch.setenv("MINIVLLM_CPU_DTYPE", "fp8")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_DTYPE"):
        default_cpu_dtype()


def test_auto_resolves_per_cpu_and_explicit_dtypes_win(llama_path, monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_DTYPE", raising=False)
    auto = EngineConfig(model=str(llama_path), device="cpu").resolve().dtype
    assert auto == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert EngineConfig(model=str(llama_path), device="cpu", dtype="float32").resolve().dtype == torch.float32


@pytest.mark.skipif(not onednn_applies(torch.bfloat16), reason="no native bf16 / oneDNN on this CPU")
def test_packed_linear_equals_f_linear():
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
        packed = reorder_weight(linear.weight)
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
            torch.testing.assert_close(packed_linear(x, packed, linear.bias), F.linear(x, linear.weight, linear.bias),
                                       atol=1e-2, rtol=1e-2)


def test_tied_weights_are_held_once_and_parameter_counts_true(checkpoints):
    """The engine's bf16 model: the tied head and the embedding share one parameter (in whatever layout the
    platform holds it), and the parameter count is the checkpoint's."""
    from transformers import AutoModelForCausalLM

    path, _ = checkpoints["qwen2"]  # tied embeddings
    model = LLM(str(path), dtype="bfloat16", device="cpu", num_kv_blocks=16).engine.runner.model
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.tied and model.lm_head.weight is model.model.embed_tokens.weight
    counted = {}  # each parameter once (the tied one is the head's and the embedding's), at its plain size
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            linear_weight = name == "weight" and hasattr(m, "quant_method")
            counted[id(p)] = plain_weight(m).numel() if linear_weight else p.numel()
    assert sum(counted.values()) == sum(p.numel() for p in hf.parameters())


def test_bf16_logprobs_track_transformers_bf16(checkpoints):
    for kind in ("llama", "qwen3"):
        path, _ = checkpoints[kind]
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
        assert llm.engine.runner.dtype == torch.bfloat16
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3, ignore_eos=True)
        worst = 0.0
        for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
            tokens = out.prompt_token_ids + out.outputs[0].token_ids
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
            positions = [(t, out.prompt_logprobs[t]) for t in range(1, len(out.prompt_token_ids))]
            positions += [(len(out.prompt_token_ids) + i, lp) for i, lp in enumerate(out.outputs[0].logprobs)]
            for t, entry in positions:
                for token_id, lp in entry.items():
                    worst = max(worst, abs(lp.logprob - float(ref[t - 1, token_id])))
        assert worst < LOGPROB_TOL, f"{kind}: bf16 logprobs differ from transformers' bf16 by up to {worst:.4f}"


def test_thread_sizer_gives_way_to_a_busy_process():
    """Processes spinning on all cores but one: the sizer drops to one thread; cpu_threads=N fixes N."""
    cores = os.cpu_count() or 1
    if not os.path.exists("/proc/stat") or not 2 <= cores <= 8:
        pytest.skip("needs /proc/stat and 2 to 8 cores (all but one are kept busy)")
    threads = torch.get_num_threads()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores - 1)]
    try:
        sizer = CpuThreadSizer(max_threads=2, interval_s=0.5)
        time.sleep(0.8)
        assert sizer.update() == 1, "other processes hold all cores but one: one thread is left for us"
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        torch.set_num_threads(threads)
    assert 1 <= sizer.update() <= 2
    fixed = CpuThreadSizer(fixed=1)
    assert torch.get_num_threads() == 1 and fixed.update() == 1
    torch.set_num_threads(threads)
