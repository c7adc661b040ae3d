"""GGUF blocks multiplied as stored (quantization/cpu_gguf.cpp): the same numbers as the `gguf`
package's dequantization followed by a float matmul, for each block format and batch size."""

import numpy as np
import pytest
import torch

from minivllm.platforms.cpu import extension_built
from minivllm.quantization import cpu_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not extension_built(), reason="no compiler: the C++ kernels are not built")
TYPES = {"Q8_0": cpu_gguf.Q8_0, "Q4_0": cpu_gguf.Q4_0, "Q4_1": cpu_gguf.Q4_1}


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by the gguf package: (blocks, the package's own dequantization)."""
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[name]
    blocks = gguf.quants.quantize(weights, kind)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy())


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_the_gguf_package(name):
    blocks, expected = quantized(name, 40, 96)
    assert blocks.shape[1] == 96 // 32 * cpu_gguf.BLOCK_BYTES[TYPES[name]]
    assert torch.equal(cpu_gguf.dequantize(blocks, TYPES[name], 40, 96), expected)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_dequantized_matmul(name, rows, dtype):
    n, k = 100, 160  # outputs not a multiple of 16 (the parallel chunk), 5 blocks per row
    blocks, weight = quantized(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cpu_gguf.gguf_linear(x, blocks, TYPES[name], n)
    want = x.double() @ weight.double().T
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # fp32 sums in another order; bf16's output rounding
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_a_shape_that_disagrees_is_refused():
    blocks, _ = quantized("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="do not hold"):
        cpu_gguf.gguf_linear(torch.randn(1, 96), blocks, cpu_gguf.Q8_0, 8)
    with pytest.raises(RuntimeError, match="not one of"):
        cpu_gguf.gguf_linear(torch.randn(1, 64), blocks, 12, 8)
