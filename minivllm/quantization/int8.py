"""Weight-only int8 (`quantization="int8"`): any float checkpoint, quantized as it loads.

Each output n gets one scale, s[n] = max_k |W[n, k]| / 127, and W is kept as q = round(W / s) in
[-127, 127]: one byte per weight. Since s depends only on n, y = x @ (q * s).T = (x @ q.T) * s: the
matmul runs on q in the activations' dtype (exact: every int8 fits fp16 and bf16) and the scale is
applied once per output (`INT8`); the CPU's and GPU's kernels skip the converted copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import (
    LinearKernel,
    LinearKernels,
    LinearMethod,
    QuantizationConfig,
)


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype,
                         absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] int8, s [N] in scale_dtype), symmetric, one scale per output.

    The scale is rounded to scale_dtype first, so q is computed against the scale the kernel will
    use. `absmax`: each row's max |w| when W is only part of the row (a row-parallel rank's inputs).
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    scale = (absmax / 127).clamp(min=torch.finfo(torch.float16).tiny).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Kernel(LinearKernel):
    """The readable kernel: convert q to x's dtype, multiply, scale each output."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale
        return y if bias is None else y + bias


INT8 = Int8Kernel()


class Int8LinearMethod(LinearMethod):
    def __init__(self, kernel: LinearKernel = INT8, quantize: Callable | None = None) -> None:
        super().__init__(kernel)
        # a learner's own quantize_per_channel (EngineHooks.int8_quantize), or None
        self.quantize = quantize

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        # (the whole row's max |w|, also when this rank holds part of the row)
        if self.quantize is None:
            q, scale = quantize_per_channel(weight, weight.dtype, layer.row_absmax(weight))
        else:
            q, scale = self.quantize(weight)
        layer.weight = nn.Parameter(q.to(torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)
        self.kernel.layout(layer)


@dataclass(frozen=True)
class Int8Config(QuantizationConfig):
    quantize: Callable | None = field(default=None, compare=False)  # EngineHooks.int8_quantize
    name = "int8"

    def linear_method(self, kernels: LinearKernels) -> LinearMethod:
        return Int8LinearMethod(kernels.int8, self.quantize)
