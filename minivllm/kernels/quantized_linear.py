"""The GPU's int8, int4 and GGUF matmuls as linear kernels for the cuda platform: the Triton kernels
of int8_linear.py, int4_linear.py and gguf_linear.py, in place of the readable ones
(quantization/int8.py, int4.py; a GGUF file's blocks are otherwise dequantized at load).

int8 (kernels/int8_linear.py) loads int8 tiles, converts them in registers and multiplies; int4
(kernels/int4_linear.py) reads GPTQ's layout as int4.py holds it (q eight to a word down the inputs,
z as bytes, s) and dequantizes each tile in registers, for groups of a multiple of 16 inputs (other
layers keep the readable kernel); GGUF (kernels/gguf_linear.py) multiplies Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K and Q6_K layers as the file's blocks (other types are dequantized at load,
model/gguf_blocks.py).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.gguf_linear import BLOCK_BYTES, dequantize_blocks, gguf_linear
from minivllm.kernels.int4_linear import int4_linear
from minivllm.kernels.int8_linear import int8_linear
from minivllm.quantization.base import LinearKernel
from minivllm.quantization.int4 import Int4Kernel
from minivllm.quantization.int8 import Int8Kernel


class TritonInt8Kernel(Int8Kernel):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.weight_scale, bias)


class TritonInt4Kernel(Int4Kernel):
    def layout(self, layer: nn.Module) -> None:
        layer.kernel = "triton" if layer.group_size % 16 == 0 else "torch"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.kernel != "triton":
            return super().apply(layer, x, bias)
        if layer.perm is not None:
            x = x[:, layer.perm]
        return int4_linear(x, layer.qweight, layer.zeros, layer.scales, layer.group_size, bias)


class TritonGgufKernel(LinearKernel):
    """W as the file's blocks (`layer.weight`, uint8 [N, bytes per row]) of `layer.ggml_type`."""

    types = tuple(BLOCK_BYTES)  # the block formats gguf_linear.py multiplies

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gguf_linear(x, layer.weight, layer.ggml_type, layer.output_size, bias)

    def plain(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_blocks(layer.weight, layer.ggml_type, layer.output_size, layer.input_size)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized: a tied embedding's lookup, in the model's dtype."""
        flat, k = ids.reshape(-1), layer.input_size
        rows = dequantize_blocks(layer.weight[flat], layer.ggml_type, flat.numel(), k)
        return rows.to(layer.compute_dtype).reshape(*ids.shape, k)


TRITON_INT8, TRITON_INT4, TRITON_GGUF = TritonInt8Kernel(), TritonInt4Kernel(), TritonGgufKernel()
