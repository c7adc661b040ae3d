"""GGUF blocks on the cuda platform (kernels/gguf_linear.py, run by Triton's interpreter here): the kernel
against the gguf package's dequantization and a float matmul, the torch dequantizer against the package, and a
GGUF file through the engine keeping its Q8_0/Q4_0/Q4_1 and Q4_K/Q6_K layers as blocks, greedy equal to
transformers."""

import numpy as np
import pytest
import torch

from minivllm.kernels.gguf_linear import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0, dequantize_blocks, gguf_linear

gguf = pytest.importorskip("gguf")
TYPES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q6_K": Q6_K}


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, the gguf package's dequantization) of random weights (Q4_K / Q6_K: random blocks with
    small fp16 scales, since the package only reads those formats)."""
    from tests.test_cpu_gguf import random_super_blocks

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[name]
    if name in ("Q4_K", "Q6_K"):
        blocks = random_super_blocks(name, n, k, rng)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy())


@pytest.mark.parametrize("name", TYPES)
def test_torch_dequantization_equals_the_gguf_package(name):
    blocks, weight = quantized(name, 37, 512)
    assert torch.equal(dequantize_blocks(blocks, TYPES[name], 37, 512), weight)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 17, 70])  # a partial tile, a taller one, several along M
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_the_dequantized_matmul(name, rows, dtype):
    # N not a whole tile; K three blocks, or two super-blocks (every sub-block of each)
    n, k = 100, 512 if name in ("Q4_K", "Q6_K") else 96
    blocks, weight = quantized(name, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        got = gguf_linear(x, blocks, TYPES[name], n, b)
        # the kernel rounds each weight to x's dtype before tl.dot, as a float model holds it
        exact = x.double() @ weight.to(dtype).double().T + (0 if b is None else b.double())
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), exact, atol=tol * k**0.5, rtol=tol)


def test_a_gguf_file_keeps_its_blocks_on_the_cuda_platform(tmp_path):
    """A tiny Llama with a tied head: attention Q4_0, the MLP Q8_0, one layer's gate/down Q4_1 (its gate/up
    fused from two types: each shard in its own), the head Q8_0; greedy equal to transformers on the dequantized
    file."""
    pytest.importorskip("accelerate")  # transformers' own GGUF loading needs it
    import transformers as tf

    from minivllm import LLM, SamplingParams
    from minivllm.kernels.quantized_linear import TritonGgufKernel
    from minivllm.quantization.gguf import write_gguf
    from tests.conftest import EMBEDDED, build_checkpoint, hf_greedy

    model = build_checkpoint("llama", tmp_path / "float", vocab_size=1834, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=True, intermediate_size=128, num_hidden_layers=2)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, EMBEDDED, types={"blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_down.weight": "Q4_1",
                                             "token_embd.weight": "Q8_0"})
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, attention_backend="triton")
    layers = llm.engine.runner.model.model.layers
    kept = {"q/k/v": layers[0].self_attn.qkv_proj, "down Q4_1": layers[1].mlp.down_proj,
            "gate/up Q8_0": layers[0].mlp.gate_up_proj, "head": llm.engine.runner.model.lm_head}
    assert all(isinstance(layer.quant_method.kernel, TritonGgufKernel) for layer in kept.values())
    assert {name: layer.ggml_type for name, layer in kept.items()} == {
        "q/k/v": Q4_0, "down Q4_1": Q4_1, "gate/up Q8_0": Q8_0, "head": Q8_0}
    mixed = layers[1].mlp.gate_up_proj  # Q4_1 and Q8_0 shards
    assert isinstance(mixed.quant_method.kernel, TritonGgufKernel) and mixed.quant_method.ggml_types == [Q4_1, Q8_0]

    hf_tok = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    texts = ["Hi, my name is", "Today is a beautiful summer day"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # the interpreter is slow
    outs = llm.generate(texts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, hf_tok(t).input_ids, 4) for t in texts]


def test_q4_k_and_q6_k_files_keep_their_super_blocks_on_the_cuda_platform(tmp_path):
    """The K formats most downloaded files hold: Q4_K and Q6_K layers multiplied as stored by the
    Triton kernel (Triton's interpreter here), greedy equal to transformers on the dequantized file."""
    pytest.importorskip("accelerate")
    from minivllm import LLM, SamplingParams
    from minivllm.kernels.quantized_linear import TritonGgufKernel
    from tests.conftest import hf_greedy
    from tests.test_cpu_gguf import write_k_gguf

    path, hf = write_k_gguf(tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, attention_backend="triton")
    layer0, layer1 = llm.engine.runner.model.model.layers
    kept = (layer1.self_attn.qkv_proj, layer0.mlp.gate_up_proj, layer1.mlp.down_proj)
    assert all(isinstance(layer.quant_method.kernel, TritonGgufKernel) for layer in kept)
    assert [layer.ggml_type for layer in kept] == [Q4_K, Q4_K, Q6_K]
    prompts = [[1, 5, 9, 300, 4, 17, 40]]  # a prompt's rows, then one decode row: ~5 s a step interpreted
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 2) for p in prompts]
