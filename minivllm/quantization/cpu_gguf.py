"""GGUF's block formats multiplied as the file stores them, on the CPU (cpu_gguf.cpp).

What users download is mostly Q8_0 or Q4: 32 weights per block sharing an fp16 scale (and, in
Q4_1, an fp16 minimum), or the "K" formats Q4_K and Q6_K: 256 weights per super-block, whose
sub-blocks of 32 (16) weights have 6-bit (8-bit) scales of their own. A Q4_K_M file also holds
Q5_0 (Q5_1): Q4_0 (Q4_1) with a fifth bit per weight, where a row's length is no multiple of 256
(a 135M Llama's 576: half its bytes). Dequantizing at load
turns a 87 MiB Q4_0 file into 514 MiB of fp32 and reads all of it every decode step; keeping the
blocks reads the file's bytes, 3.7-5.9x fewer. `gguf_linear` multiplies a few rows of x
straight from the blocks (a decode step's batch); past GGUF_MAX_ROWS rows (a prompt) one
dequantized copy per call and a GEMM are faster, as for the tiled float kernel. Tested against
the `gguf` package's own dequantization (tests/test_cpu_gguf.py).

`CPU_GGUF` is the cpu platform's kernel for GGUF layers (quantization/gguf.py's GgufLinearMethod):
it reads the blocks the loader copied in, and dequantizes rows where a tied embedding looks tokens
up in the LM head's blocks.

Two arithmetics. By default x stays float and meets the exact weights: greedy tokens equal
transformers' on the dequantized model. llama.cpp instead quantizes x to 8 bits per 32 values and
multiplies in integers (AVX512-VNNI's vpdpbusd: 64 products an instruction; AVX2's vpmaddubsw and
vpmaddwd: 32 products in two); where the model
computes in bf16 or fp16 anyway (MINIVLLM_CPU_GGUF_ACTIVATIONS, minivllm/envs.py), Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K and Q6_K layers do too (`kernel_type` = the file's type | PACKED): `layout`
regroups each row's 32-weight blocks four at a time (the same bytes), so that one load reads four
blocks' codes; the K formats' super-blocks serve as they are. x goes in per 32 values everywhere
(llama.cpp takes 256 for the K formats: a little faster, coarser around a large activation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs
from minivllm.quantization.base import GGUF_BLOCKS, LinearKernel, NativePart

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 2, 3, 6, 7, 8, 12, 14  # ggml's type ids (GGUFReader's)
# (weights, bytes) per block: Q4_K and Q6_K group 256 weights into a super-block (cpu_gguf.cpp)
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q6_K: (256, 210)}
GGUF_MAX_ROWS = 32  # beyond, dequantize once per call and multiply with the float GEMM
PACKED = 256  # type | PACKED: x goes in as int8 (every type; rows regrouped by gguf_pack)
# type | PACKED | INTERLEAVED: Q4_0 / Q5_0 rows interleaved 8 at a time (gguf_pack) where AVX2
# multiplies int8 x: a block's eight dot products come out as one vector, a row per lane, with no
# sum across lanes (Q4_0, 1536 x 576 at batch 1, 2 threads of a Zen 3: 39 us regrouped, 25 here)
INTERLEAVED = 512


def dequantize(blocks: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """uint8 [n, k / block weights * block bytes] -> W [n, k] fp32, as llama.cpp dequantizes."""
    return torch.ops.minivllm_cpu.gguf_dequantize(blocks, ggml_type, n, k)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int) -> torch.Tensor:
    """x @ W.T with W [n, x.shape[-1]] held as GGUF blocks, in x's dtype (sums in fp32)."""
    rows = x.numel() // x.shape[-1]
    if rows > GGUF_MAX_ROWS:
        weight = dequantize(blocks, ggml_type, n, x.shape[-1]).to(x.dtype)
        return F.linear(x, weight)
    return torch.ops.minivllm_cpu.gguf_linear(x, blocks, ggml_type, n)


def register_fake() -> None:
    """gguf_linear's output shape for torch.compile (model/compiled.py); call after building."""
    torch.library.register_fake("minivllm_cpu::gguf_linear")(
        lambda x, blocks, ggml_type, n: x.new_empty(*x.shape[:-1], n))


def int8_activations(dtype: torch.dtype) -> bool:
    """Whether the block layers of a model computing in `dtype` take llama.cpp's int8 path."""
    wanted = envs.MINIVLLM_CPU_GGUF_ACTIVATIONS
    if wanted == "auto":
        wanted = "float" if dtype == torch.float32 else "int8"
    return wanted == "int8" and torch.ops.minivllm_cpu.gguf_int8_dot()


class CpuGgufKernel(LinearKernel):
    """W as the file's blocks (`layer.weight`, uint8 [N, bytes per row]) of `layer.ggml_type`,
    multiplied as `layer.kernel_type` (the same type, or packed for int8 activations)."""

    types = tuple(BLOCKS)  # the block formats cpu_gguf.cpp multiplies

    def layout(self, layer: nn.Module) -> None:
        """Rows regrouped (Q4_0's and Q5_0's interleaved, where they can) where x goes in as int8
        (the same bytes, in place)."""
        layer.kernel_type = layer.ggml_type
        if int8_activations(layer.compute_dtype):
            packed = layer.ggml_type | PACKED
            if (layer.ggml_type in (Q4_0, Q5_0) and layer.weight.shape[0] % 8 == 0
                    and torch.ops.minivllm_cpu.gguf_interleaves()):
                packed |= INTERLEAVED
            layer.weight.data = torch.ops.minivllm_cpu.gguf_pack(layer.weight, packed)
            layer.kernel_type = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = gguf_linear(x, layer.weight, layer.kernel_type, layer.output_size)
        return y if bias is None else y + bias

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The op itself over the blocks; a prompt's rows (x [T, K]) as `apply` takes them."""
        op, blocks, ggml_type, n, bias = (torch.ops.minivllm_cpu.gguf_linear.default, layer.weight,
                                          layer.kernel_type, layer.output_size, layer.bias)
        if bias is not None:
            return lambda x: self.apply(layer, x, bias)
        return lambda x: (op(x, blocks, ggml_type, n) if x.shape[0] <= GGUF_MAX_ROWS
                          else self.apply(layer, x, None))

    def native(self, layer: nn.Module) -> list[NativePart]:
        return [NativePart(GGUF_BLOCKS, layer.weight, layer.kernel_type, layer.output_size,
                           GGUF_MAX_ROWS)]

    def plain(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] in float (fp32), exactly as llama.cpp dequantizes it."""
        return dequantize(layer.weight, layer.kernel_type, layer.output_size, layer.input_size)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized: a tied embedding's lookup, in the model's dtype."""
        flat = ids.reshape(-1)
        if layer.kernel_type & INTERLEAVED:  # a row lives in its group of 8: dequantize the groups
            blocks = layer.weight.view(-1, 8 * layer.weight.shape[1])[flat // 8]
            groups = dequantize(blocks.view(-1, layer.weight.shape[1]), layer.kernel_type,
                                8 * flat.numel(), layer.input_size)
            rows = groups.view(-1, 8, layer.input_size)[torch.arange(flat.numel()), flat % 8]
        else:
            rows = dequantize(layer.weight[flat], layer.kernel_type, flat.numel(), layer.input_size)
        return rows.to(layer.compute_dtype).reshape(*ids.shape, layer.input_size)


CPU_GGUF = CpuGgufKernel()
