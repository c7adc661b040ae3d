"""Float weights as the checkpoint has them: y = x @ W.T + b.

On a CPU (fp32, or bf16 where the CPU has native bf16) the weights are reordered once, after loading, into
oneDNN's blocked layout and multiplied by its linear primitive (minivllm/model/packed_linear.py: about 1.5x
faster than `F.linear`, which re-blocks the weight on every call). With AVX-512 each weight is also laid out for
the small-batch kernel (minivllm/model/small_linear.py), which serves calls of up to SMALL_ROWS rows: decode
steps. A weight tied to the embedding keeps the embedding's parameter and the packed copy is held beside it;
`plain_weight` reads a packed weight back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.packed_linear import packed_linear, packing_applies, reorder_weight
from minivllm.model.small_linear import SMALL_ROWS, pack_small, small_linear, small_linear_applies
from minivllm.quantization.base import Layout, LinearMethod, add_weight


class UnquantizedLinearMethod(LinearMethod):
    layout_copies = ("packed_weight", "small_weight")

    def __init__(self, triton: bool = False) -> None:
        self.triton = triton  # nothing to launch: cuBLAS (through F.linear) is the float GEMM on a GPU

    def create_weights(self, layer: nn.Module) -> None:
        shape = (layer.output_size, layer.input_size)
        add_weight(layer, "weight", shape, torch.float32, Layout(output_dim=0, input_dim=1))
        layer.packed = False
        layer.register_buffer("small_weight", None, persistent=False)  # set by process_weights_after_loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        layer.packed = packing_applies(weight.device, weight.dtype)
        if not layer.packed:
            return
        if small_linear_applies(weight.device, weight.dtype):
            layer.register_buffer("small_weight", pack_small(weight), persistent=False)
        packed = reorder_weight(weight)
        if layer.tied:  # the embedding still reads the plain weight
            layer.register_buffer("packed_weight", packed, persistent=False)
        else:
            layer.weight = nn.Parameter(packed, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not layer.packed:
            return F.linear(x, layer.weight, bias)
        if layer.small_weight is not None and x.shape[0] <= SMALL_ROWS and not torch.compiler.is_compiling():
            return small_linear(x, layer.small_weight, bias, layer.output_size)
        return packed_linear(x, getattr(layer, "packed_weight", layer.weight), bias)
