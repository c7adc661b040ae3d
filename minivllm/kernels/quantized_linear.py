"""The GPU's int8 and int4 matmuls as linear kernels for the cuda platform: the Triton kernels of
int8_linear.py and int4_linear.py, in place of the readable ones (quantization/int8.py, int4.py).

int8 (kernels/int8_linear.py) loads int8 tiles, converts them in registers and multiplies; int4
(kernels/int4_linear.py) reads GPTQ's layout as int4.py holds it (q eight to a word down the inputs,
z as bytes, s) and dequantizes each tile in registers, for groups of a multiple of 16 inputs (other
layers keep the readable kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels.int4_linear import int4_linear
from minivllm.kernels.int8_linear import int8_linear
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


TRITON_INT8, TRITON_INT4 = TritonInt8Kernel(), TritonInt4Kernel()
