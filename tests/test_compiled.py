"""The CPU compiled path (model/compiled.py): equal to transformers in fp32, off under enforce_eager, and a
failing compile falls back to eager with a warning. Compiling is slow: one test compiles, on two families."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.model.compiled import CompiledLayers
from tests.conftest import hf_greedy

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40)), [42] * 9]


def greedy(llm: LLM, prompts=PROMPTS, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_compiled_layers_match_transformers(checkpoints, monkeypatch):
    """Prefill (several token counts), batch-1 and batched decode all run compiled, fp32, bias-free Llama and
    Qwen3 (q/k norms): the same greedy tokens as transformers."""
    monkeypatch.setenv("MINIVLLM_CPU_COMPILE", "1")
    for kind in ("llama", "qwen3"):
        path, model = checkpoints[kind]
        llm = LLM(path, block_size=16, num_kv_blocks=64, dtype="float32")
        compiled = llm.engine.runner.compiled
        assert compiled is not None and compiled.active
        assert greedy(llm) == [hf_greedy(model, p, 12) for p in PROMPTS]
        assert greedy(llm, PROMPTS[:1], 4) == [hf_greedy(model, PROMPTS[0], 4)]  # batch 1: its own graph
        assert compiled.failed is None and compiled.active


def test_enforce_eager_keeps_the_plain_layers(checkpoints, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_COMPILE", "1")
    llm = LLM(checkpoints["llama"][0], num_kv_blocks=32, enforce_eager=True)
    assert not isinstance(llm.engine.runner.compiled, CompiledLayers)  # the bound layers, if any
    assert not any("before_attention" in layer.__dict__ for layer in llm.engine.runner.model.model.layers)


def test_off_unless_asked(checkpoints, monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_COMPILE", raising=False)
    assert not isinstance(LLM(checkpoints["llama"][0], num_kv_blocks=32).engine.runner.compiled, CompiledLayers)
    monkeypatch.setenv("MINIVLLM_CPU_COMPILE", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_COMPILE"):
        LLM(checkpoints["llama"][0], num_kv_blocks=32)


def test_a_failing_compile_falls_back_to_eager(checkpoints, monkeypatch):
    """No C++ compiler, an op inductor cannot lower: the step still completes, eager, and says so once."""
    monkeypatch.setenv("MINIVLLM_CPU_COMPILE", "1")
    path, model = checkpoints["llama"]
    llm = LLM(path, num_kv_blocks=32, dtype="float32")
    compiled = llm.engine.runner.compiled

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    for layer in compiled.layers:
        for piece in ("before_attention", "after_attention"):
            layer.__dict__[piece].compiled = broken
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        tokens = greedy(llm)
    assert tokens == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert isinstance(compiled.failed, RuntimeError) and not compiled.active
