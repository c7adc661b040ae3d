"""Weight-only int8 (`quantization="int8"`): any float checkpoint, quantized as it loads.

Each output channel n (a row of W [N, K]) gets one scale, s[n] = max_k |W[n, k]| / 127, and the weight is
kept as q = round(W / s[:, None]) in [-127, 127]: one byte per weight instead of two (bf16) or four (fp32).
Activations stay in float; since s depends only on n, y = x @ (q * s[:, None]).T = (x @ q.T) * s, so the
matmul runs on q converted to the activations' dtype (exact: every int8 fits fp16 and bf16) and the scale
is applied once per output. CPU: torch's `_weight_int8pack_mm` does exactly that, in bf16/fp16 for up to
KERNEL_MAX_ROWS rows (beyond, converting q and calling the float matmul is faster; in fp32 the kernel is a
slow reference loop: bench/RESULTS.md); GPU: a Triton kernel (minivllm/kernels/int8_linear.py) loads int8
tiles, converts them in registers and multiplies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import Layout, LinearMethod, QuantizationConfig, add_weight

KERNEL_MAX_ROWS = 32  # CPU: _weight_int8pack_mm up to this many rows (measured: slower than dequantizing beyond)


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype,
                         absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] int8, s [N] in scale_dtype), symmetric, one scale per output channel.

    The scale is rounded to scale_dtype first, so q is computed against the scale the kernel will use.
    `absmax`: each row's max |w| when W is only part of the row (a row-parallel rank's slice of the inputs).
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    scale = (absmax / 127).clamp(min=torch.finfo(torch.float16).tiny).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


class Int8LinearMethod(LinearMethod):
    def __init__(self, triton: bool = False, quantize: Callable | None = None) -> None:
        self.triton = triton
        self.quantize = quantize  # a learner's own quantize_per_channel (EngineHooks.int8_quantize), or None

    def create_weights(self, layer: nn.Module) -> None:
        # the checkpoint is float: load W as it is, quantize after
        add_weight(layer, "weight", (layer.output_size, layer.input_size), torch.float32, Layout(0, 1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        if self.quantize is None:  # (the whole row's max |w|, also when this rank holds part of the row)
            q, scale = quantize_per_channel(weight, weight.dtype, layer.row_absmax(weight))
        else:
            q, scale = self.quantize(weight)
        layer.weight = nn.Parameter(q.to(torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = layer.weight, layer.weight_scale
        if self.triton:
            from minivllm.kernels.int8_linear import int8_linear

            return int8_linear(x, q, scale, bias)
        # bf16 needs K % 16 == 0: otherwise torch 2.13's CPU kernel reads past the row (wrong sums or a
        # crash: found by tests/test_quantization.py)
        if (x.device.type == "cpu" and x.shape[0] <= KERNEL_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
                and (x.dtype != torch.bfloat16 or q.shape[1] % 16 == 0)):
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale)
        else:  # convert, multiply, scale: large batches, fp32, and a GPU's torch reference
            y = F.linear(x, q.to(x.dtype)) * scale
        return y if bias is None else y + bias


@dataclass(frozen=True)
class Int8Config(QuantizationConfig):
    quantize: Callable | None = field(default=None, compare=False)  # EngineHooks.int8_quantize
    name = "int8"

    def linear_method(self, triton: bool) -> LinearMethod:
        return Int8LinearMethod(triton, self.quantize)
