"""The cpu platform's bound decoder layers (model/cpu_bound_layer.py): the same kernels in the same order as the
module path, so every logprob is bitwise equal with them on and off, whether a layer runs as one C++ op
(model/cpu_decoder_layer.cpp: tiled float weights, GGUF blocks) or as flat Python (other formats), and whether the
whole stack then runs as one op (BoundStack) or not; an fp8 cache takes the module path; lazy loading fills a layer
before it is bound; a hook on a layer is called at every step."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.cpu_bound_layer import BoundLayer, BoundStack
from tests.conftest import hf_greedy

PROMPTS = [list(range(3, 43)), [5, 6, 7], [42] * 9]  # the first: more rows than GGUF's block kernel takes


def run(path, monkeypatch, bound: bool, prompts=PROMPTS, **kwargs):
    """(tokens, their logprobs and 4 alternatives' per step) of a batch, and the engine."""
    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "1" if bound else "0")
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    steps = [[sorted(step.items()) for step in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], steps, llm


def layers(llm) -> list:
    return list(llm.engine.runner.model.model.layers)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # plain; q/k/v bias; q/k norms
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bound_layers_equal_the_module_path_bitwise(checkpoints, monkeypatch, kind, dtype):
    from minivllm.platforms.cpu import tiled_applies

    tiled = tiled_applies(getattr(torch, dtype))
    path, model = checkpoints[kind]
    tokens, logprobs, llm = run(path, monkeypatch, True, dtype=dtype)
    bound = [layer.forward for layer in layers(llm)]
    assert all(isinstance(f, BoundLayer) and f.run is not None for f in bound)  # decode steps ran bound
    assert all(f.native is not None for f in bound) == tiled  # as one C++ op where the weights are tiled
    stack = llm.engine.runner.model.forward
    assert isinstance(stack, BoundStack) and (stack.constants is not None) == tiled  # and the stack as one
    plain_tokens, plain_logprobs, plain = run(path, monkeypatch, False, dtype=dtype)
    assert not any("forward" in layer.__dict__ for layer in layers(plain))
    assert tokens == plain_tokens and logprobs == plain_logprobs
    if dtype == "float32":
        assert tokens == [hf_greedy(model, p, 10) for p in PROMPTS]


def test_a_bound_layer_runs_from_the_first_step(checkpoints, monkeypatch):
    path, _ = checkpoints["llama"]
    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "1")
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, dtype="float32")
    assert all(layer.forward.run is None for layer in layers(llm))  # bound when first run, not at load
    llm.engine.add_request("long", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.engine.step()  # the prompt: 40 rows
    assert all(layer.forward.run is not None for layer in layers(llm))


def test_sliding_window_layers_bind_with_their_own_window(tmp_path, monkeypatch):
    """Qwen2 with `max_window_layers`: layers with and without a window (two groups of block tables)."""
    from tests.conftest import build_checkpoint

    model = build_checkpoint("qwen2", tmp_path / "q", use_sliding_window=True, sliding_window=8,
                             max_window_layers=1, num_hidden_layers=3)
    tokens, logprobs, llm = run(tmp_path / "q", monkeypatch, True, dtype="float32")
    assert [layer.forward.run is not None for layer in layers(llm)] == [True] * 3
    assert (tokens, logprobs) == run(tmp_path / "q", monkeypatch, False, dtype="float32")[:2]
    assert tokens == [hf_greedy(model, p, 10) for p in PROMPTS]


def test_lazy_loading_binds_the_loaded_layers(checkpoints, monkeypatch):
    path, model = checkpoints["qwen3"]
    tokens, _, llm = run(path, monkeypatch, True, dtype="float32", lazy_loading=True)
    assert all(layer.forward.run is not None for layer in layers(llm))
    assert tokens == [hf_greedy(model, p, 10) for p in PROMPTS]


def test_an_fp8_cache_takes_the_module_path(checkpoints, monkeypatch):
    """The C++ attention reads a cache of the activations' dtype only: an fp8 cache goes to the reference."""
    path, _ = checkpoints["llama"]
    tokens, logprobs, llm = run(path, monkeypatch, True, dtype="float32", kv_cache_dtype="fp8")
    assert all(layer.forward.run is None for layer in layers(llm))
    assert (tokens, logprobs) == run(path, monkeypatch, False, dtype="float32", kv_cache_dtype="fp8")[:2]


def test_gguf_blocks_bind(tmp_path, monkeypatch):
    """A GGUF file's Q4_0/Q8_0 layers: the GGUF kernel's op bound directly, bitwise equal to the module path."""
    from minivllm.quantization.gguf import write_gguf
    from tests.conftest import EMBEDDED, build_checkpoint

    model = build_checkpoint("llama", tmp_path / "f", vocab_size=1834, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=True, intermediate_size=128, num_hidden_layers=2)
    write_gguf(tmp_path / "t.gguf", model, EMBEDDED, types={"blk.0.attn_v.weight": "Q4_0"})
    prompts = [list(range(3, 43)), [7, 8, 9]]  # 40 rows: the prompt's matmuls dequantize
    tokens, logprobs, llm = run(tmp_path / "t.gguf", monkeypatch, True, prompts, dtype="float32")
    assert layers(llm)[1].self_attn.qkv_proj.weight.dtype == torch.uint8
    assert all(layer.forward.run is not None for layer in layers(llm))
    assert llm.engine.runner.model.forward.constants is not None  # decode steps ran the stack as one op
    assert (tokens, logprobs) == run(tmp_path / "t.gguf", monkeypatch, False, prompts, dtype="float32")[:2]


def test_a_hook_on_a_layer_sees_every_step(checkpoints, monkeypatch):
    """The stack op would skip a layer's hooks (the chapters' and a learner's probes): with one registered, the
    model's own forward runs, and the hook sees every step."""
    path, _ = checkpoints["llama"]
    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "1")
    llm = LLM(str(path), block_size=16, num_kv_blocks=64, dtype="float32")
    seen = []
    handle = layers(llm)[1].register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hooked = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert seen == [3] + [1] * 5  # the prompt's step, then five decode steps
    handle.remove()
    plain = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(seen) == 6 and plain == hooked


def test_the_platform_table_names_the_bound_layers(monkeypatch):
    from minivllm.platforms.cpu import CpuPlatform

    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "1")
    table = CpuPlatform("cpu", torch.float32).op_table()
    if table["attention"].endswith("CpuAttentionBackend"):  # the extension built here
        assert table["decoder_layer"] == "minivllm.model.cpu_bound_layer.bind_decoder_layers"
    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "0")
    table = CpuPlatform("cpu", torch.float32).op_table()
    assert table["decoder_layer"] == "minivllm.model.llama.DecoderLayer.forward" and table["compile"] == "none"


def test_int8_weights_bind_as_python_and_equal_the_module_path(checkpoints, monkeypatch):
    """A format whose matmul has no C++ part (torch's int8 kernel) keeps the flat Python function."""
    path, _ = checkpoints["llama"]
    tokens, logprobs, llm = run(path, monkeypatch, True, dtype="float32", quantization="int8")
    assert all(f.run is not None and f.native is None for f in (layer.forward for layer in layers(llm)))
    assert (tokens, logprobs) == run(path, monkeypatch, False, dtype="float32", quantization="int8")[:2]
