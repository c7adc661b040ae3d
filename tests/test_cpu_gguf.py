"""GGUF blocks multiplied as stored (quantization/cpu_gguf.cpp): the same numbers as the `gguf`
package's dequantization followed by a float matmul, for each block format and batch size."""

import numpy as np
import pytest
import torch

from minivllm.platforms.cpu import extension_built
from minivllm.quantization import cpu_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not extension_built(), reason="no compiler: the C++ kernels are not built")
TYPES = {"Q8_0": cpu_gguf.Q8_0, "Q4_0": cpu_gguf.Q4_0, "Q4_1": cpu_gguf.Q4_1, "Q5_0": cpu_gguf.Q5_0,
         "Q5_1": cpu_gguf.Q5_1, "Q4_K": cpu_gguf.Q4_K, "Q6_K": cpu_gguf.Q6_K}
SUPER = ("Q4_K", "Q6_K")  # 256 weights per super-block: a row needs whole super-blocks


def random_super_blocks(name: str, n: int, k: int, rng: np.random.Generator,
                        scale: tuple[float, float] = (0.001, 0.02)) -> np.ndarray:
    """Q4_K / Q6_K blocks of random bytes (every bit pattern is a valid code) with finite fp16 scales in `scale`:
    the gguf package only dequantizes these formats."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    blocks = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    scales = rng.uniform(*scale, (n, k // weights, 2)).astype(np.float16).view(np.uint8)
    if name == "Q4_K":  # d, dmin lead the block
        blocks[..., 0:4] = scales.reshape(n, k // weights, 4)
    else:  # Q6_K: d ends it
        blocks[..., 208:210] = scales[..., :2]
    return blocks.reshape(n, -1)


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by the gguf package (random blocks for Q4_K/Q6_K): (blocks, the package's own
    dequantization)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[name]
    if name in SUPER:
        blocks = random_super_blocks(name, n, k, rng)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy())


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_the_gguf_package(name):
    k = 512 if name in SUPER else 96
    blocks, expected = quantized(name, 40, k)
    weights, nbytes = cpu_gguf.BLOCKS[TYPES[name]]
    assert blocks.shape[1] == k // weights * nbytes == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1] * (
        k // weights)
    assert torch.equal(cpu_gguf.dequantize(blocks, TYPES[name], 40, k), expected)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [*range(1, 10), 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_dequantized_matmul(name, rows, dtype):
    # every batch size 1-8 has its own instance (9: one pass of 8 then one of 1; 33: the dequantize + GEMM path);
    # 103 outputs leave a remainder after groups of 8, 4 and 2 output rows and after the 16-row parallel grain;
    # 19 blocks of 32 cross the 16-block chunk whose scales are converted ahead, 3 super-blocks for Q4_K/Q6_K
    n, k = 103, 768 if name in SUPER else 608
    blocks, weight = quantized(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cpu_gguf.gguf_linear(x, blocks, TYPES[name], n)
    want = x.double() @ weight.double().T
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # fp32 sums in another order; bf16's output rounding
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    own = cpu_gguf.dequantize(blocks, TYPES[name], n, k)  # the same weights, by the kernel's own dequantization
    torch.testing.assert_close(got.double(), x.double() @ own.double().T, rtol=tolerance,
                               atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_x_is_the_fp32_path_rounded(name, dtype):
    """bf16 / fp16 x (and a 3-D x of any dtype) go through the fp32 kernels: widened in, rounded out to nearest
    even, bit for bit what fp32 x followed by torch's own cast gives."""
    n, k = 70, 768 if name in SUPER else 608
    blocks, _ = quantized(name, n, k)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    fp32 = cpu_gguf.gguf_linear(x.float().reshape(6, k), blocks, TYPES[name], n)
    got = cpu_gguf.gguf_linear(x, blocks, TYPES[name], n)
    assert got.dtype == dtype and got.shape == (2, 3, n)
    assert torch.equal(got, fp32.to(dtype).reshape(2, 3, n))
    assert torch.equal(cpu_gguf.gguf_linear(x.float(), blocks, TYPES[name], n), fp32.reshape(2, 3, n))
    transposed = x.transpose(0, 1)  # not contiguous: copied first
    assert torch.equal(cpu_gguf.gguf_linear(transposed, blocks, TYPES[name], n),
                       fp32.to(dtype).reshape(2, 3, n).transpose(0, 1))


@pytest.mark.parametrize("name", TYPES)
def test_every_output_row_is_its_own(name):
    """One weight row at a time set apart (the others zero) lands in its own output column only: a transposed
    sum (cpu_gguf.cpp's store_totals) that mixed up rows of a group would put it in another one."""
    n, k = 19, 256
    blocks, weight = quantized(name, n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    zero, _ = quantized(name, 1, k)  # a row whose scales are all zero: every weight 0
    zero[:] = 0
    for row in range(n):
        alone = zero.repeat(n, 1)
        alone[row] = blocks[row]
        got = cpu_gguf.gguf_linear(x, alone, TYPES[name], n)[0]
        want = torch.zeros(n, dtype=torch.float64)
        want[row] = (x.double() @ weight[row].double()).item()
        # fp32 sums: the error scales with the products' magnitudes, not with their (cancelling) total
        scale = (x.double().abs() @ weight[row].double().abs()).item()
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale)


def test_a_shape_that_disagrees_is_refused():
    blocks, _ = quantized("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="do not hold"):
        cpu_gguf.gguf_linear(torch.randn(1, 96), blocks, cpu_gguf.Q8_0, 8)
    with pytest.raises(RuntimeError, match="not one of"):
        cpu_gguf.gguf_linear(torch.randn(1, 64), blocks, 13, 8)  # Q5_K: no kernel


# --- int8 activations: llama.cpp's arithmetic (packed Q4_0 / Q8_0 rows) ---------------------------------------
int8_dot = pytest.mark.skipif(not (extension_built() and torch.ops.minivllm_cpu.gguf_int8_dot()),
                              reason="the int8 path needs AVX2 or AVX512-VNNI")


def quantized_per_32(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: per 32 values d = max |x| / 127, q = round(x / d) (half to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@int8_dot
@pytest.mark.parametrize("name,n,k", [(name, n, k) for name in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
                                      for n, k in [(103, 608), (19, 64), (8, 96), (40, 32)]]  # 1-3 blocks left over
                         + [(name, n, k) for name in SUPER for n, k in [(103, 768), (19, 256)]])
def test_packed_rows_hold_the_same_weights_and_multiply_int8_x_exactly(name, n, k):
    """Packing regroups the bytes (dequantized: the same weights; Q4_K, Q6_K keep their layout); the int8 path
    equals x quantized per 32 values times the exact weights up to fp32 sums, every batch size 1-8, 9 (8 + 1)
    and 33 (dequantize + GEMM, float x)."""
    blocks, weight = quantized(name, n, k, seed=n)
    packed = torch.ops.minivllm_cpu.gguf_pack(blocks, TYPES[name])
    kind = TYPES[name] | cpu_gguf.PACKED
    moves = k > 32 and name not in SUPER  # a row of one block keeps its order, as do super-blocks
    assert packed.shape == blocks.shape and torch.equal(packed, blocks) != moves
    assert torch.equal(cpu_gguf.dequantize(packed, kind, n, k), weight)
    for rows in [*range(1, 10), 33]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = cpu_gguf.gguf_linear(x, packed, kind, n).double()
        want = (x if rows > cpu_gguf.GGUF_MAX_ROWS else quantized_per_32(x)).double() @ weight.double().T
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


interleaves = pytest.mark.skipif(not (extension_built() and torch.ops.minivllm_cpu.gguf_interleaves()),
                                 reason="Q4_0 and Q5_0 rows interleave for AVX2's int8 kernel only")


@interleaves
@pytest.mark.parametrize("name", ["Q4_0", "Q5_0"])
@pytest.mark.parametrize("n,k", [(8, 32), (16, 96), (104, 608), (192, 576)])
def test_interleaved_rows_hold_the_same_weights_and_multiply_int8_x_exactly(name, n, k):
    """Q4_0 and Q5_0 rows interleaved 8 at a time: the same weights (dequantized whole, and row by row as a tied
    embedding looks them up), and x quantized per 32 values times them up to fp32 sums, every batch size 1-9 and
    33 (Q5_0's codes reach 31: its 16-bit sums must widen before they overflow)."""
    from types import SimpleNamespace

    blocks, weight = quantized(name, n, k, seed=n)
    kind = TYPES[name] | cpu_gguf.PACKED | cpu_gguf.INTERLEAVED
    interleaved = torch.ops.minivllm_cpu.gguf_pack(blocks, kind)
    assert interleaved.shape == blocks.shape and not torch.equal(interleaved, blocks)
    assert torch.equal(cpu_gguf.dequantize(interleaved, kind, n, k), weight)
    layer = SimpleNamespace(weight=interleaved, kernel_type=kind, input_size=k, compute_dtype=torch.float32)
    ids = torch.tensor([[n - 1, 0], [3, 3]])
    assert torch.equal(cpu_gguf.CPU_GGUF.rows(layer, ids), weight[ids])
    for rows in [*range(1, 10), 33]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = cpu_gguf.gguf_linear(x, interleaved, kind, n).double()
        want = (x if rows > cpu_gguf.GGUF_MAX_ROWS else quantized_per_32(x)).double() @ weight.double().T
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@interleaves
def test_only_q4_0_and_q5_0_rows_in_eights_interleave():
    blocks, _ = quantized("Q4_0", 12, 64)
    with pytest.raises(RuntimeError, match="8 at a time"):
        torch.ops.minivllm_cpu.gguf_pack(blocks, cpu_gguf.Q4_0 | cpu_gguf.PACKED | cpu_gguf.INTERLEAVED)
    blocks, _ = quantized("Q8_0", 16, 64)
    with pytest.raises(RuntimeError, match="8 at a time"):
        torch.ops.minivllm_cpu.gguf_pack(blocks, cpu_gguf.Q8_0 | cpu_gguf.PACKED | cpu_gguf.INTERLEAVED)


# --- a GGUF file loaded on the cpu platform keeps its blocks --------------------------------------------------

SIZES = dict(intermediate_size=128, num_hidden_layers=2)  # hidden 64, q 64, k/v 32: whole blocks of 32


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny Llama with a tied embedding as a GGUF file of several types: attention Q4_0, MLP Q8_0, layer 1's
    gate Q4_1 (its fused gate/up mixes two types), layer 0's v Q8_0 (q/k/v mixes two), token_embd Q8_0, layer
    0's down Q5_0 and layer 1's o Q5_1 (as llama.cpp's Q4_K_M writes rows of no multiple of 256)."""
    from tests.conftest import EMBEDDED, build_checkpoint

    root = tmp_path_factory.mktemp("gguf-cpu")
    model = build_checkpoint("llama", root / "float", vocab_size=1834, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=True, **SIZES)
    from minivllm.quantization.gguf import write_gguf

    types = {"blk.1.ffn_gate.weight": "Q4_1", "blk.0.attn_v.weight": "Q8_0", "token_embd.weight": "Q8_0",
             "blk.1.ffn_down.weight": "Q4_1", "blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_output.weight": "Q5_1"}
    write_gguf(root / "tiny-mixed.gguf", model, EMBEDDED, types=types)
    return root / "tiny-mixed.gguf"


def test_a_gguf_file_keeps_its_blocks_and_matches_transformers(mixed_gguf):
    pytest.importorskip("accelerate")  # transformers' own GGUF loading needs it
    import transformers as tf

    from minivllm import LLM, SamplingParams
    from minivllm.quantization import held_bytes
    from tests.conftest import hf_greedy

    llm = LLM(str(mixed_gguf), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    layer0, layer1 = model.model.layers
    kept = {"layer 0 o": layer0.self_attn.o_proj, "layer 0 gate/up": layer0.mlp.gate_up_proj,
            "layer 0 down": layer0.mlp.down_proj, "layer 1 q/k/v": layer1.self_attn.qkv_proj,
            "layer 1 o": layer1.self_attn.o_proj, "layer 1 down": layer1.mlp.down_proj, "tied head": model.lm_head}
    types = {name: layer.ggml_type for name, layer in kept.items()}
    assert types == {"layer 0 o": cpu_gguf.Q4_0, "layer 0 gate/up": cpu_gguf.Q8_0, "layer 0 down": cpu_gguf.Q5_0,
                     "layer 1 q/k/v": cpu_gguf.Q4_0, "layer 1 o": cpu_gguf.Q5_1, "layer 1 down": cpu_gguf.Q4_1,
                     "tied head": cpu_gguf.Q8_0}
    # fused layers whose shards differ: each shard's blocks in its own type, one flat tensor
    mixed = {"layer 0 q/k/v": layer0.self_attn.qkv_proj, "layer 1 gate/up": layer1.mlp.gate_up_proj}
    assert {name: layer.quant_method.ggml_types for name, layer in mixed.items()} == {
        "layer 0 q/k/v": [cpu_gguf.Q4_0, cpu_gguf.Q4_0, cpu_gguf.Q8_0],
        "layer 1 gate/up": [cpu_gguf.Q4_1, cpu_gguf.Q8_0]}
    assert all(layer.weight.dtype == torch.uint8 for layer in [*kept.values(), *mixed.values()])
    assert model.model.embed_tokens.weight is model.lm_head.weight  # rows looked up in the head's blocks

    # held: exactly the file's tensors (the norms float32 as in the file), and the rotary tables
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(mixed_gguf).tensors)
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())
    assert held_bytes(model) - rotary == file_bytes

    hf_tok = tf.AutoTokenizer.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name)
    hf = tf.AutoModelForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name,
                                                 dtype=torch.float32).eval()
    texts = ["Hi, my name is", "Today is a beautiful summer day"]
    prompts = [hf_tok(t).input_ids for t in texts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]


@int8_dot
def test_int8_activations_pack_q4_0_and_q8_0_and_stay_near_transformers(mixed_gguf, monkeypatch):
    """MINIVLLM_CPU_GGUF_ACTIVATIONS: 'auto' keeps fp32 exact and takes the int8 path in bf16; 'int8' in fp32
    packs the 32-weight layers in place (the same bytes held), and its logprobs stay as near transformers' on the
    dequantized model as bf16's with float x do (the honest bar: int8 x rounds about as coarsely as bf16)."""
    import transformers as tf

    from minivllm import LLM, SamplingParams
    from minivllm.quantization import held_bytes
    from tests.test_gemma3 import logprobs_against

    def head(llm):
        return llm.engine.runner.model.lm_head

    exact = LLM(str(mixed_gguf), dtype="float32", num_kv_blocks=64)
    assert head(exact).kernel_type == cpu_gguf.Q8_0
    assert head(LLM(str(mixed_gguf), dtype="bfloat16", num_kv_blocks=64)).kernel_type == cpu_gguf.Q8_0 | cpu_gguf.PACKED
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_ACTIVATIONS", "int8")
    llm = LLM(str(mixed_gguf), dtype="float32", num_kv_blocks=64)
    layer0, layer1 = llm.engine.runner.model.model.layers
    kinds = (cpu_gguf.Q4_0, cpu_gguf.Q8_0, cpu_gguf.Q4_1, cpu_gguf.Q5_0, cpu_gguf.Q5_1)
    interleaved = cpu_gguf.INTERLEAVED if torch.ops.minivllm_cpu.gguf_interleaves() else 0  # 64 rows: 8 eights
    assert (layer0.self_attn.o_proj.kernel_type, layer0.mlp.gate_up_proj.kernel_type, layer1.mlp.down_proj.kernel_type,
            layer0.mlp.down_proj.kernel_type, layer1.self_attn.o_proj.kernel_type) == tuple(
                kind | cpu_gguf.PACKED | (interleaved if kind in (cpu_gguf.Q4_0, cpu_gguf.Q5_0) else 0)
                for kind in kinds)
    assert held_bytes(llm.engine.runner.model) == held_bytes(exact.engine.runner.model)
    ids = torch.tensor([0, 7, 1833])
    torch.testing.assert_close(llm.engine.runner.model.model.embed_tokens(ids),
                               exact.engine.runner.model.model.embed_tokens(ids))  # rows from packed blocks

    hf = tf.AutoModelForCausalLM.from_pretrained(mixed_gguf.parent, gguf_file=mixed_gguf.name,
                                                 dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 300, 4, 17, 250, 3], list(range(40, 60)))]
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_ACTIVATIONS", "float")
    bf16 = LLM(str(mixed_gguf), dtype="bfloat16", num_kv_blocks=64)
    worst = {name: logprobs_against(hf, engine.generate(prompts, params, use_tqdm=False))
             for name, engine in (("float", exact), ("int8", llm), ("bf16", bf16))}
    # measured: float 5e-6, int8 0.088, bf16 (float x) 0.083: int8 x costs what bf16 already costs
    assert worst["float"] < 1e-4 and 1e-3 < worst["int8"] < 1.5 * worst["bf16"], worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: x as int8 where the CPU multiplies so
def test_the_cpp_decoder_layer_serves_the_blocks_bitwise_as_the_module_path(mixed_gguf, monkeypatch, dtype):
    """Decode steps of a GGUF file run as one C++ op per layer (model/cpu_decoder_layer.cpp), fused layers whose
    shards differ in type included: every logprob equals the module path's (bound layers off)."""
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 300, 4], list(range(40, 80)), [7] * 3)]
    runs = {}
    for bound in ("1", "0"):
        monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", bound)
        llm = LLM(str(mixed_gguf), dtype=dtype, num_kv_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[bound] = [(o.outputs[0].token_ids, [sorted(s.items()) for s in o.outputs[0].logprobs]) for o in outs]
        if bound == "1":
            assert all(layer.forward.native is not None for layer in llm.engine.runner.model.model.layers)
    assert runs["1"] == runs["0"]


def test_the_reference_platform_dequantizes_a_gguf_file(mixed_gguf, monkeypatch):
    from minivllm import LLM

    monkeypatch.setenv("MINIVLLM_PLATFORM", "reference")
    llm = LLM(str(mixed_gguf), dtype="float32", num_kv_blocks=64)
    layers = llm.engine.runner.model.model.layers
    assert llm.engine.runner.platform.linear.gguf is None
    assert layers[0].self_attn.o_proj.weight.dtype == torch.float32


def write_k_gguf(tmp_path) -> tuple[object, object]:
    """Rows of 256 weights (whole super-blocks): a tiny Llama of hidden size 256 whose layers hold random Q4_K and
    Q6_K blocks (small scales), layer 0's q/k/v mixing Q4_K with a Q6_K v (dequantized), as Q4_K_M files do.
    (the file's path, transformers' model of it)."""
    import transformers as tf

    from minivllm.quantization.gguf import write_gguf
    from tests.conftest import EMBEDDED, build_checkpoint

    model = build_checkpoint("llama", tmp_path / "float", vocab_size=1834, bos_token_id=1, eos_token_id=2,
                             hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    rng, types, raw = np.random.default_rng(0), {}, {}
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    for layer in range(2):
        for part, (n, k) in shapes.items():
            name = f"blk.{layer}.{part}.weight"
            types[name] = "Q6_K" if part in ("ffn_down",) or (layer == 0 and part == "attn_v") else "Q4_K"
            raw[name] = random_super_blocks(types[name], n, k, rng, scale=(1e-4, 3e-4))
    write_gguf(tmp_path / "tiny-k.gguf", model, EMBEDDED, types=types, raw=raw)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny-k.gguf", dtype=torch.float32).eval()
    return tmp_path / "tiny-k.gguf", hf


def test_q4_k_and_q6_k_layers_keep_their_super_blocks_and_match_transformers(tmp_path):
    pytest.importorskip("accelerate")
    from minivllm import LLM, SamplingParams
    from tests.conftest import hf_greedy

    path, hf = write_k_gguf(tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    layer0, layer1 = llm.engine.runner.model.model.layers
    assert layer0.self_attn.qkv_proj.quant_method.ggml_types == [cpu_gguf.Q4_K, cpu_gguf.Q4_K, cpu_gguf.Q6_K]
    assert (layer1.self_attn.qkv_proj.ggml_type, layer0.mlp.gate_up_proj.ggml_type, layer0.self_attn.o_proj.ggml_type,
            layer1.mlp.down_proj.ggml_type) == (cpu_gguf.Q4_K, cpu_gguf.Q4_K, cpu_gguf.Q4_K, cpu_gguf.Q6_K)

    prompts = [[1, 5, 9, 300, 4], list(range(7, 60))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


@int8_dot
def test_q4_k_and_q6_k_layers_multiply_the_engines_own_activations_as_int8(tmp_path, monkeypatch):
    """The K formats on the int8 path inside the engine, a fused layer of two types included: every block layer's
    output, on the activations a prompt really sends it, equals those activations quantized per 32 values times
    the exact weights. (This fixture's MLP inputs peak at 400x their median, and int8 x is coarse there: its
    logprobs stray up to ~4 from transformers' where bf16's stray 0.1, a limit of llama.cpp's arithmetic that
    the default only takes where the model computes in bf16/fp16 anyway.)"""
    from minivllm import LLM, SamplingParams

    path, _ = write_k_gguf(tmp_path)
    monkeypatch.setenv("MINIVLLM_CPU_GGUF_ACTIVATIONS", "int8")
    monkeypatch.setenv("MINIVLLM_CPU_BOUND_LAYERS", "0")  # the modules' forward: hooks see each call
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj  # Q4_K q/k beside a Q6_K v
    assert [qkv.kernel_type_0, qkv.kernel_type_2] == [cpu_gguf.Q4_K | cpu_gguf.PACKED, cpu_gguf.Q6_K | cpu_gguf.PACKED]
    worst = {}

    def check(name):
        def hook(module, args, out):
            x = args[0].float()
            parts = module.quant_method.shards(module) if hasattr(module.quant_method, "shards") else [module]
            weight = torch.cat([cpu_gguf.dequantize(p.weight, p.kernel_type, p.output_size, p.input_size)
                                for p in parts])
            want = quantized_per_32(x).double() @ weight.double().T
            worst[name] = ((out.double() - want).abs().max() / want.abs().max()).item()
        return hook

    for name, module in llm.engine.runner.model.named_modules():
        if getattr(module, "weight", None) is not None and module.weight.dtype == torch.uint8:
            module.register_forward_hook(check(name))
    llm.generate([{"prompt_token_ids": list(range(40, 60))}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(worst) == 8 and max(worst.values()) < 1e-5, worst


def test_kept_blocks_go_through_the_weight_cache(mixed_gguf, tmp_path):
    """Data-parallel engines map one copy of the loaded model (model/weight_cache.py): the blocks, a fused layer
    holding shards of two types and the tied head's blocks lent to the embedding come back as loaded."""
    from minivllm.model.loader import load_model, read_model_config
    from minivllm.platforms import choose_platform

    cfg = read_model_config(mixed_gguf)
    impl = choose_platform("cpu", torch.float32).implementations
    written, mapped = (load_model(mixed_gguf, cfg, impl, torch.float32, "cpu", weight_cache=tmp_path)
                       for _ in range(2))
    assert any(tmp_path.iterdir())
    ids, hidden = torch.tensor([0, 5, 1833]), torch.randn(3, 64)
    for model in (written, mapped):
        assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.uint8
        assert model.model.embed_tokens.weight is model.lm_head.weight
    assert torch.equal(written.model.embed_tokens(ids), mapped.model.embed_tokens(ids))
    assert torch.equal(written.lm_head(hidden), mapped.lm_head(hidden))
    layer = (written.model.layers[0].self_attn.qkv_proj, mapped.model.layers[0].self_attn.qkv_proj)  # two types
    assert torch.equal(layer[0](hidden), layer[1](hidden))


PORTABLE = """
import sys
import torch
from torch.utils.cpp_extension import load

source, build, data, *without = sys.argv[1:]
load(name="minivllm_gguf_portable", sources=[source], build_directory=build, is_python_module=False,
     extra_cflags=["-O3", "-march=native", *without, "-fopenmp"], extra_ldflags=["-fopenmp"])
ops = torch.ops.minivllm_cpu
out = []
for x, blocks, t, n, k in torch.load(data):
    if t & 256:  # x as int8: rows packed first, where this build has an integer dot product (AVX2 or VNNI)
        if not ops.gguf_int8_dot() or (t & 512 and not ops.gguf_interleaves()):
            out.append(None)
            continue
        blocks = ops.gguf_pack(blocks, t)
    out.append((ops.gguf_linear(x, blocks, t, n), ops.gguf_dequantize(blocks, t, n, k)))
torch.save(out, data)
"""


PORTABLE_BUILDS = {"avx2": ["-mno-avx512f"], "plain": ["-mno-avx512f", "-mno-avx2"]}


def host_build(build: str) -> bool:
    """Whether this machine's own build already is `build` (an AVX2 CPU without AVX-512: the tests above ran it)."""
    from minivllm.platforms.cpu_hardware import cpu_flags

    flags = cpu_flags()
    return build == "avx2" and "avx512f" not in flags and {"avx2", "fma"} <= flags


@pytest.fixture(scope="module", autouse=True)
def portable_builds(tmp_path_factory):
    """Every format and batch through cpu_gguf.cpp built without AVX-512 (its AVX2 vectors) and without AVX2 too
    (its plain loops), each build alone in a subprocess, all at once, started before this module's first test
    (a compile keeps one core ~25 s: the tests above run beside it): ({build: (folder, process)}, [(x @ W.T in
    float64, W)]), or None without a compiler."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("c++") is None:
        yield None
        return
    source = Path(cpu_gguf.__file__).with_suffix(".cpp")
    cases, wants = [], []
    for name in TYPES:
        n, k = 11, 512 if name in SUPER else 96
        blocks, weight = quantized(name, n, k)
        for rows, packed in [(1, False), (5, False), (9, False), (1, True), (8, True)]:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            cases.append((x, blocks, TYPES[name] | (cpu_gguf.PACKED if packed else 0), n, k))
            wants.append(((quantized_per_32(x) if packed else x).double() @ weight.double().T, weight))
    for name in ("Q4_0", "Q5_0"):  # AVX2's interleaved rows
        blocks, weight = quantized(name, 16, 96)
        for rows in (1, 3):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            cases.append((x, blocks, TYPES[name] | cpu_gguf.PACKED | cpu_gguf.INTERLEAVED, 16, 96))
            wants.append((quantized_per_32(x).double() @ weight.double().T, weight))
    running = {}
    for build, without in PORTABLE_BUILDS.items():
        if host_build(build):
            continue
        folder = tmp_path_factory.mktemp(build)
        torch.save(cases, folder / "cases.pt")
        (folder / "build").mkdir()
        running[build] = folder, subprocess.Popen(
            [sys.executable, "-c", PORTABLE, str(source), str(folder / "build"), str(folder / "cases.pt"), *without])
    yield running, wants
    for _, process in running.values():  # a test that never waited (deselected, or failed before)
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def portable_results(portable_builds):
    """({build: [(output, dequantized)]}, [(x @ W.T in float64, W)]) once the builds have run."""
    if portable_builds is None:
        pytest.skip("no C++ compiler")
    running, wants = portable_builds
    outputs = {}
    for build, (folder, process) in running.items():
        assert process.wait(timeout=600) == 0, f"the {build} build failed"
        outputs[build] = torch.load(folder / "cases.pt")
    return outputs, wants


@pytest.mark.parametrize("build", PORTABLE_BUILDS)
def test_the_loops_without_avx512_compute_the_same(portable_results, build):
    """For CPUs that lack AVX-512 (or AVX2 too): the same numbers as the gguf package's dequantization followed
    by a matmul; with AVX2, x quantized to int8 (packed rows: 1-3 blocks left over, 1 and 8 rows of x) too."""
    if host_build(build):
        pytest.skip(f"this CPU's own build is the {build} one: every test above ran it")
    outputs, wants = portable_results
    assert (None in outputs[build]) == (build == "plain")  # the int8 path needs AVX2
    for output, (want, weight) in zip(outputs[build], wants, strict=True):
        if output is None:
            continue
        got, dequantized = output
        assert torch.equal(dequantized, weight)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
