"""The CPU fast path's fused layer ops (model/cpu_layer_ops.py) against the readable torch code they replace.

bf16 (and fp16) follow the readable model's rounding step by step, so results must equal it but for the odd
last-place difference (RMSNorm's sum of squares runs in another order, silu's exp is another polynomial); fp32 agrees to
rounding. Odd sizes, q/k norm on strided views, residual adds, and rotary with a llama3-scaled table.
"""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_layer_ops, layer_ops
from minivllm.model.llama import RMSNorm
from minivllm.model.rotary import RotaryEmbedding
from minivllm.platforms import choose_platform, cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


@pytest.fixture(scope="module")
def ops():
    if not cpu.extension_built():
        pytest.skip("no C++ compiler: the CPU layer ops cannot be built here")
    return cpu_layer_ops.OPS


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal to rounding; bf16, fp16: equal, but for at most 1% of elements one step of the dtype apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    differ = got != want
    assert differ.float().mean().item() <= 0.01, f"{differ.sum().item()} of {got.numel()} elements differ"
    step = 2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim,with_residual", [(1, 576, True), (7, 100, False), (13, 37, True), (64, 576, True)])
def test_rms_norm(ops, tokens, dim, with_residual, dtype):
    gen = torch.Generator().manual_seed(dim + tokens)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    x = torch.randn(tokens, dim, generator=gen).mul(4).to(dtype)
    residual = torch.randn(tokens, dim, generator=gen).mul(4).to(dtype) if with_residual else None
    out, new_residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
    if with_residual:
        want, want_residual = norm(x, residual)
        assert torch.equal(new_residual, want_residual)  # the add rounds once, in the model's dtype, as torch does
    else:
        want = norm(x)
        assert new_residual is None
    assert_matches(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (5, 24), (2, 33)])
def test_qk_norm_on_a_strided_view(ops, heads, head_dim, dtype):
    """Qwen3's per-head norm: rows of head_dim carved out of a wider fused-projection output."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    norm = RMSNorm(head_dim, 1e-6).to(dtype)
    norm.weight.data = torch.randn(head_dim, generator=gen).to(dtype)
    qkv = torch.randn(9, heads * head_dim + 11, generator=gen).to(dtype)
    x = qkv[:, 5 : 5 + heads * head_dim].view(9, heads, head_dim)
    out, _ = ops.rms_norm(x, norm.weight, norm.eps)
    assert_matches(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,scaling", [(64, 9, 3, None), (24, 4, 2, LLAMA3), (64, 3, 1, LLAMA3),
                                                             (18, 5, 5, None)])
def test_rotary_in_place(ops, head_dim, heads, kv_heads, scaling, dtype):
    """q and k as strided views of one fused qkv output, rotated in place; v untouched."""
    gen = torch.Generator().manual_seed(head_dim + heads)
    rope = RotaryEmbedding(head_dim, 300, 500000.0 if scaling else 10000.0, scaling)
    rope.build()
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).mul(3).to(dtype)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    q, k, v = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = ops.rotary(positions, q, k, rope.cos_sin)
    assert got_q is q and got_k is k
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    assert torch.equal(v, qkv[:, (heads + kv_heads) * head_dim :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 1536), (5, 100), (3, 37), (64, 1536)])
def test_silu_and_mul(ops, tokens, intermediate, dtype):
    gen = torch.Generator().manual_seed(intermediate + tokens)
    gate_up = torch.randn(tokens, 2 * intermediate + 6, generator=gen).mul(4).to(dtype)[:, 3 : 3 + 2 * intermediate]
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0], dtype=dtype)  # silu's tails and zero
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_the_cpu_platform_brings_them_and_the_switches_take_them_away(ops, monkeypatch):
    assert choose_platform("cpu", torch.float32).ops == ops
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_OPS", "0")
    assert choose_platform("cpu", torch.float32).ops == layer_ops.REFERENCE
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_OPS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_ATTENTION", "reference")
    assert choose_platform("cpu", torch.float32).ops == layer_ops.REFERENCE
    monkeypatch.setenv("MINIVLLM_CPU_ATTENTION", "kernel")
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_OPS", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_LAYER_OPS"):
        choose_platform("cpu", torch.float32)


def test_missing_compiler_keeps_the_readable_ops(monkeypatch):
    monkeypatch.setattr(cpu, "extension_built", lambda: False)
    assert choose_platform("cpu", torch.float32).ops == layer_ops.REFERENCE
