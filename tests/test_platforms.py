"""Which platform runs where (minivllm/platforms/), what each one's op table says, that the
reference uses no C++ op, and that every weight is held once: parameters + buffers within 1.15x of
the weights' bytes."""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm import LLM, SamplingParams
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import ModelConfig
from minivllm.platforms import CpuPlatform, ReferencePlatform, choose_platform, platform_name
from minivllm.quantization import held_bytes, weight_bytes
from minivllm.quantization.int8 import Int8Config

OPS = {"attention", "rms_norm", "rotary", "silu_and_mul", "linear[float]", "linear[int8]", "linear[int4]",
       "linear[gguf]", "linear[float].layout", "linear[int8].layout", "linear[int4].layout",
       "linear[gguf].layout", "moe_experts", "decoder_layer", "compile",
       "cuda_graphs"}


@pytest.mark.parametrize("device,backend,env,want", [
    ("cpu", "auto", "auto", "cpu"), ("cpu", "torch", "auto", "cpu"), ("cpu", "triton", "auto", "cuda"),
    ("cuda", "auto", "auto", "cuda"), ("cuda", "torch", "auto", "reference"), ("cuda", "triton", "auto", "cuda"),
    ("cpu", "auto", "reference", "reference"), ("cuda", "auto", "reference", "reference"),
    ("cpu", "torch", "cpu", "cpu"), ("cpu", "auto", "cuda", "cuda"), ("mps", "auto", "auto", "reference"),
])
def test_which_platform(device, backend, env, want, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", env)
    assert platform_name(device, backend) == want


def test_contradictions_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", "reference")
    with pytest.raises(ValueError, match="contradicts"):
        platform_name("cpu", "triton")
    monkeypatch.setenv("MINIVLLM_PLATFORM", "gpu")
    with pytest.raises(ValueError, match="MINIVLLM_PLATFORM"):
        platform_name("cpu")
    monkeypatch.delenv("MINIVLLM_PLATFORM")
    with pytest.raises(ValueError, match="attention_backend"):
        platform_name("cpu", "flash")
    with pytest.raises(ValueError, match="runs on the CPU"):
        CpuPlatform("cuda", torch.float32)


def test_every_fast_path_names_the_test_that_ties_it_to_the_reference():
    from minivllm.platforms.cuda import CudaPlatform  # Triton: interpreted here (tests/conftest.py)

    root = Path(__file__).resolve().parent.parent
    reference = ReferencePlatform("cpu", torch.float32).op_table()
    for platform in (choose_platform("cpu", torch.float32), CudaPlatform("cpu", torch.float32)):
        table = platform.op_table()
        fast = {op for op, impl in table.items() if impl != reference[op] and not op.endswith(".layout")}
        assert fast - {"compile"} <= set(platform.tested_by), platform.name  # compile is opt-in
        assert all((root / path).is_file() for path in platform.tested_by.values())


def test_op_tables():
    ref = ReferencePlatform("cpu", torch.float32).op_table()
    assert set(ref) == OPS
    assert ref["attention"] == "minivllm.attention.torch_backend.TorchAttentionBackend"
    assert ref["rms_norm"] == "minivllm.model.layer_ops.rms_norm"
    assert ref["linear[float]"] == "minivllm.quantization.unquantized.FloatKernel.apply"
    assert ref["linear[int8]"] == "minivllm.quantization.int8.Int8Kernel.apply"
    assert ref["compile"] == ref["cuda_graphs"] == "none"
    cpu = choose_platform("cpu", torch.float32).op_table()
    assert set(cpu) == OPS
    assert cpu["linear[int8]"] == "minivllm.quantization.cpu_quantized.CpuInt8Kernel.apply"
    if cpu["attention"].endswith("CpuAttentionBackend"):  # the extension built here
        assert cpu["rms_norm"] == "minivllm.model.cpu_layer_ops.rms_norm"
    assert all(not name.startswith("minivllm.kernels") for name in {**ref, **cpu}.values())


def test_the_online_softmax_hook_replaces_attention_on_any_platform():
    update = lambda *args: args  # noqa: E731 -- never called here
    for cls in (ReferencePlatform, CpuPlatform):
        assert cls("cpu", torch.float32, update).attention.update is update


class Namespaces(TorchDispatchMode):
    """Every operator namespace dispatched while active (aten, mkldnn, minivllm_cpu, ...)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.namespace)
        return func(*args, **(kwargs or {}))


def test_the_reference_platform_runs_no_cpp_op(llama_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PLATFORM", "reference")
    llm = LLM(str(llama_path), num_kv_blocks=32, dtype="float32")
    assert llm.engine.runner.platform.name == "reference"
    with Namespaces() as mode:
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=3),
                     use_tqdm=False)
    assert "aten" in mode.seen and not mode.seen & {"minivllm_cpu", "mkldnn", "minivllm"}


# --- each weight held once
# -------------------------------------------------------------------------------------

# SmolLM2-135M's shapes, two layers, the vocabulary scaled with them (its embedding stays ~21% of
# the weights)
SMOL = ModelConfig(model_type="llama", vocab_size=3264, hidden_size=576, intermediate_size=1536, num_layers=2,
                   num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                   rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True, qkv_bias=False,
                   qk_norm=False, torch_dtype=None, eos_token_id=None)


def random_model(platform, dtype, quantization=None) -> LlamaForCausalLM:
    """What load_model builds, with random weights instead of a checkpoint's."""
    cfg = ModelConfig(**{**SMOL.__dict__, "quantization": quantization})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, platform.implementations)
    model = model.to_empty(device="cpu").to(dtype)
    model.lm_head.tie_to(model.model.embed_tokens)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    for m in model.modules():
        if hasattr(m, "quant_method"):
            m.process_weights_after_loading()
    model.share_tied_weight()
    return model


@pytest.mark.parametrize("platform", ["reference", "cpu"])
def test_each_weight_is_held_once(platform):
    ratios, held = {}, {}
    for name, dtype, quant in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                               ("int8", torch.bfloat16, Int8Config())):
        plain = weight_bytes(random_model(ReferencePlatform("cpu", dtype), dtype, quant))
        model = random_model(choose_platform("cpu", dtype) if platform == "cpu" else
                             ReferencePlatform("cpu", dtype), dtype, quant)
        held[name] = held_bytes(model)
        ratios[name] = held[name] / plain
        ids = torch.tensor([0, 3, 64, SMOL.vocab_size - 1])
        assert model.model.embed_tokens(ids).shape == (4, SMOL.hidden_size)
    assert all(r <= 1.15 for r in ratios.values()), ratios
    assert held["int8"] <= 0.35 * held["fp32"], held
