"""The CPU's tiled linear kernel (quantization/cpu_unquantized.py) against F.linear, and where the
engine uses it: every float weight held once, in the tiled layout, for decode steps and prompts
alike."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM
from minivllm.platforms.cpu import extension_built, tiled_applies
from minivllm.quantization.cpu_unquantized import (
    TILED_MAX_ROWS,
    TiledKernel,
    pack_tiles,
    tiled_linear,
    unpack_tiles,
)
from minivllm.quantization.unquantized import plain_weight

DTYPES = [d for d in (torch.float32, torch.bfloat16) if tiled_applies(d)] if extension_built() else []
pytestmark = pytest.mark.skipif(not DTYPES, reason="no AVX-512 or AVX2 (or no compiler): the tiled kernel is not used")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (64, 64), (7, 5), (100, 33), (1834, 256)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 64, 200])
def test_equals_f_linear(dtype, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    tiled = pack_tiles(w)
    assert torch.equal(unpack_tiles(tiled, out_features, in_features), w)  # the layout only moves values
    for bias in (None, b):
        got = tiled_linear(x, tiled, bias, out_features)
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.shape == (rows, out_features) and got.dtype == dtype
        if dtype == torch.float32:  # fp32 sums in another order: a few ulps of the largest term
            torch.testing.assert_close(got.double(), exact, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
        else:  # bf16: fp32 sums rounded once, as oneDNN's; within one bf16 ulp of the exact result
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * in_features ** 0.5).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3])
def test_tiles_cut_into_runs_when_threads_do_not_divide_them(dtype, threads):
    """9 tiles (576 outputs) on 2 threads: for a few rows each tile's steps cut into runs, the runs' fp32 sums
    added after; for many rows (40) each tile's rows cut in two (15 tiles on 2, or 9 on 3, split closely enough
    as whole tiles); one thread as the yardstick, with a bias."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    for out_features, in_features in ((576, 576), (960, 576), (576, 1536)):
        w, b = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
        tiled, b = pack_tiles(w.to(dtype)), b.to(dtype)
        for rows in (1, 5, 40):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            try:
                torch.set_num_threads(1)
                whole = tiled_linear(x, tiled, b, out_features)
                torch.set_num_threads(threads)
                runs = tiled_linear(x, tiled, b, out_features)
            finally:
                torch.set_num_threads(before)
            if dtype == torch.float32:
                torch.testing.assert_close(runs, whole, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
            else:  # each rounded once from fp32 sums that differ in the last bits: one bf16 ulp apart at most
                assert ((runs.float() - whole.float()).abs() <= whole.float().abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_a_non_contiguous_input(dtype):
    w = torch.randn(96, 40).to(dtype)
    x = torch.randn(3, 2, 80).to(dtype)[..., ::2]
    got = tiled_linear(x, pack_tiles(w), None, 96)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_holds_each_weight_once_tiled(dtype):
    """Decode rows and prompt rows both go through the one tiled layout; the tied head lends it to
    the embedding, which looks its rows up there."""
    model = LLM(dtype=str(dtype).removeprefix("torch."), num_kv_blocks=64).engine.runner.model
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer.quant_method.kernel, TiledKernel) and layer.weight.dim() == 4
    w = plain_weight(layer)
    # decode rows (one row per pass), more rows (AVX2 fp32: blocks of 6 rows) and prompt rows (unpacked
    # per call)
    for rows in (1, 8, 9, 40, TILED_MAX_ROWS + 1):
        x = torch.randn(rows, w.shape[1]).to(dtype)
        torch.testing.assert_close(layer(x).float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)
    head, embedding = model.lm_head, model.model.embed_tokens
    if head.tied:
        assert embedding.weight is head.weight and head.weight.dim() == 4
        ids = torch.tensor([0, 5, 63, 64, embedding.rows - 1])
        assert torch.equal(embedding(ids), plain_weight(head)[ids])


def test_the_switch_leaves_every_call_to_onednn(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_SMALL_LINEAR", "0")
    layer = LLM(dtype="float32", num_kv_blocks=64).engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.is_mkldnn
