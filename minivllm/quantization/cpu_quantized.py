"""The CPU's int8 and int4 matmuls: torch's packed-weight kernels, beside int8.py's and int4.py's.

int8: `_weight_int8pack_mm` multiplies the int8 weight with x in bf16/fp16 without a converted copy,
for up to INT8_MAX_ROWS rows (beyond, converting q and calling the float matmul is faster; in fp32
the kernel is a slow reference loop: bench/RESULTS.md), so other calls take the readable path.

int4: `_weight_int4pack_mm_for_cpu` reads its own layout ([N, K/2] bytes, and per group a scale and
an offset: W = (q - 8) * s + (8 - z) * s, the same numbers regrouped), which replaces GPTQ's at
load. Only for bf16/fp16 (in fp32 it is 10-100x slower than dequantizing, measured in
bench/RESULTS.md), the group sizes it takes, and outputs a multiple of 16; other layers keep the
readable kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.quantization.int4 import Int4Kernel, unpack_rows
from minivllm.quantization.int8 import Int8Kernel

INT8_MAX_ROWS = 32  # measured: dequantizing and the float matmul are faster beyond
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_DTYPES = (torch.bfloat16, torch.float16)  # where it is the fast path (see above)


class CpuInt8Kernel(Int8Kernel):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q = layer.weight
        # bf16 needs K % 16 == 0: otherwise torch 2.13's CPU kernel reads past the row (wrong sums
        # or a crash: found by tests/test_quantization.py)
        if (x.shape[0] > INT8_MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
                or (x.dtype == torch.bfloat16 and q.shape[1] % 16)):
            return super().apply(layer, x, bias)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, layer.weight_scale)
        return y if bias is None else y + bias


class CpuInt4Kernel(Int4Kernel):
    def layout(self, layer: nn.Module) -> None:
        scales = layer.scales
        if (scales.dtype not in INT4_DTYPES or layer.group_size not in INT4_GROUP_SIZES
                or layer.output_size % 16):
            return super().layout(layer)
        q, s = unpack_rows(layer.qweight), scales.float()
        offsets = (8 - layer.zeros.float()) * s
        del layer.qweight, layer.zeros, layer.scales
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous(), 1)
        layer.register_buffer("qweight", packed, persistent=False)
        scales_and_zeros = torch.stack([s, offsets], dim=-1).to(scales.dtype)
        layer.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        layer.kernel = "cpu"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.kernel != "cpu":
            return super().apply(layer, x, bias)
        if layer.perm is not None:
            x = x[:, layer.perm]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.qweight,
                                                       layer.group_size, layer.scales_and_zeros)
        return y if bias is None else y + bias


CPU_INT8, CPU_INT4 = CpuInt8Kernel(), CpuInt4Kernel()
