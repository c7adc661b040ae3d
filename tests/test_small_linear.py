"""The small-batch CPU linear kernel (model/small_linear.py) against F.linear, and where the engine uses it."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.model.packed_linear import plain_weight
from minivllm.model.small_linear import SMALL_ROWS, pack_small, small_linear, small_linear_applies

DTYPES = [d for d in (torch.float32, torch.bfloat16) if small_linear_applies("cpu", d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="no AVX-512 (or no compiler): oneDNN serves every call here")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (64, 64), (7, 5), (100, 33), (1834, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
def test_equals_f_linear(dtype, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x, b = torch.randn(rows, in_features, generator=gen).to(dtype), torch.randn(out_features, generator=gen).to(dtype)
    packed = pack_small(w)
    for bias in (None, b):
        got = small_linear(x, packed, bias, out_features)
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.shape == (rows, out_features) and got.dtype == dtype
        if dtype == torch.float32:  # fp32 sums in another order: a few ulps of the largest term
            torch.testing.assert_close(got.double(), exact, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
        else:  # bf16: fp32 sums rounded once, as oneDNN's; within one bf16 ulp of the exact result
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * in_features ** 0.5).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_a_non_contiguous_input(dtype):
    w = torch.randn(96, 40).to(dtype)
    x = torch.randn(3, 2, 80).to(dtype)[..., ::2]
    got = small_linear(x, pack_small(w), None, 96)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_uses_it_for_decode_and_onednn_for_prompts(dtype, monkeypatch):
    llm = LLM(dtype=str(dtype).removeprefix("torch."), num_kv_blocks=64)
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.small_weight is not None and layer.weight.is_mkldnn
    # the small layout holds the same values as the plain weight
    w = plain_weight(layer.weight)
    x = torch.randn(SMALL_ROWS, w.shape[1]).to(dtype)
    torch.testing.assert_close(layer(x).float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)
    calls = []
    monkeypatch.setattr("minivllm.quantization.unquantized.small_linear",
                        lambda *a: calls.append(a[0].shape[0]) or small_linear(*a))
    llm.generate(["Once upon a time there was a little dog who"], use_tqdm=False)
    assert calls and max(calls) <= SMALL_ROWS


def test_layout_copies_are_counted_apart_from_the_format():
    from minivllm.quantization import layout_copy_bytes, weight_bytes

    model = LLM(dtype="float32", num_kv_blocks=64).engine.runner.model
    layers = model.model.layers
    plain = sum(p.numel() * 4 for p in layers.parameters())  # every decoder weight once, in fp32
    assert weight_bytes(layers) == plain
    # each linear weight again in the small-batch layout (tiles padded to 64 rows)
    linear = sum(m.output_size * m.input_size * 4 for m in layers.modules() if hasattr(m, "small_weight"))
    assert linear <= layout_copy_bytes(layers) <= 1.3 * linear


def test_the_switch_leaves_every_call_to_onednn(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_SMALL_LINEAR", "0")
    assert not small_linear_applies("cpu", torch.float32)
    layer = LLM(dtype="float32", num_kv_blocks=64).engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.small_weight is None and layer.weight.is_mkldnn
