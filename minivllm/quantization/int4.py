"""What GPTQ and AWQ share: 4-bit weights with a scale and a zero point per group of G inputs.

Both store, for W [N outputs, K inputs] (here [K, N], as their kernels read it), a 4-bit q in
0..15, and per group of G consecutive inputs and per output a zero point z and a scale s:

    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]

eight q (or z) per int32 word. They differ only in which way the words run and in what order the
eight nibbles sit (gptq.py, awq.py); each format's `unpack` returns plain q, z, s, after which the
two share everything: the weights are held as GPTQ stores them (q packed eight to a word down the
inputs, z as bytes, s), and a kernel multiplies them. `INT4`, the readable one, dequantizes and
multiplies; the CPU's (cpu_quantized.py: torch's int4 kernel, in its own layout) and the GPU's
(kernels/quantized_linear.py: dequantized tile by tile in registers) sit beside it. Each records
its choice in `layer.kernel` ("torch", "cpu", "triton").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import LinearKernel, LinearMethod

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of a word sits at bits 4i..4i+3


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word down the rows -> int32 [8R, C] (row 8r + i)."""
    nibbles = (packed[:, None, :] >> SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word across the columns -> int32 [R, 8C] (col 8c + i)."""
    return ((packed[:, :, None] >> SHIFTS.to(packed.device)) & 0xF).reshape(packed.shape[0], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32 (>= 2**31 become negative)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_rows: [8R, C] values in 0..15 -> int32 [R, C]."""
    q = q.to(torch.int64).reshape(-1, 8, q.shape[1])
    return _to_int32((q << SHIFTS.to(torch.int64).to(q.device)[None, :, None]).sum(dim=1))


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_cols: [R, 8C] values in 0..15 -> int32 [R, C]."""
    q = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    return _to_int32((q << SHIFTS.to(torch.int64).to(q.device)).sum(dim=2))


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """q [K, N], zeros and scales [K/G, N] -> W.T [K, N] in fp32: (q - z) * s, group by group."""
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (q.to(torch.float32) - z) * scales.to(torch.float32).repeat_interleave(group_size, dim=0)


class Int4Kernel(LinearKernel):
    """The readable kernel: unpack, dequantize (q - z) * s, multiply."""

    def layout(self, layer: nn.Module) -> None:
        layer.kernel = "torch"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.perm is not None:
            x = x[:, layer.perm]
        w = dequantize(unpack_rows(layer.qweight), layer.zeros, layer.scales, layer.group_size)
        y = F.linear(x, w.T.to(x.dtype))
        return y if bias is None else y + bias


INT4 = Int4Kernel()


class Int4LinearMethod(LinearMethod):
    """The loading both formats share; subclasses declare their tensors and unpack them."""

    def __init__(self, group_size: int, kernel: LinearKernel = INT4) -> None:
        super().__init__(kernel)
        self.group_size = group_size

    def group(self, layer: nn.Module) -> int:
        return layer.input_size if self.group_size == -1 else self.group_size

    def unpack(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor | None]:
        """(q [K, N], z [K/G, N], s [K/G, N], perm or None): with perm, input k of the unpacked
        weight is the layer's input perm[k] (GPTQ's act-order): x[:, perm] multiplies it."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales, perm = self.unpack(layer)
        for name in list(layer.layouts):
            if name != "bias":
                delattr(layer, name)
        layer.perm, layer.group_size = perm, self.group(layer)
        layer.register_buffer("qweight", pack_rows(q).contiguous(), persistent=False)  # as GPTQ
        layer.register_buffer("zeros", zeros.to(torch.uint8).contiguous(), persistent=False)
        layer.register_buffer("scales", scales.contiguous(), persistent=False)
        self.kernel.layout(layer)
