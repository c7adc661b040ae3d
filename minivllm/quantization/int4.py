"""What GPTQ and AWQ share: 4-bit weights with a scale and a zero point per group of G inputs.

Both store W [N, K] as [K, N], a 4-bit q in 0..15 and per group and output a zero z and scale s,
W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], eight q (or z) per int32 word. They differ only
in which way the words run and the nibbles' order (gptq.py, awq.py); each format's `unpack` returns
plain q, z, s, then the weights are held as GPTQ stores them and a kernel multiplies them: `INT4`
(readable: dequantize, multiply), the CPU's (cpu_quantized.py) or the GPU's
(kernels/quantized_linear.py), which records itself in `layer.kernel`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import Layout, LinearKernel, LinearMethod, add_weight

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of a word sits at bits 4i..4i+3


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word down the rows -> int32 [8R, C] (row 8r + i)."""
    return unpack_cols(packed.T).T


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word across the columns -> int32 [R, 8C] (col 8c + i)."""
    return ((packed[:, :, None] >> SHIFTS.to(packed.device)) & 0xF).reshape(packed.shape[0], -1)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_rows: [8R, C] values in 0..15 -> int32 [R, C]."""
    return pack_cols(q.T).T.contiguous()


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_cols: [R, 8C] values in 0..15 -> int32 [R, C]."""
    q = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    # summed in int64, then the low 32 bits as int32 (a word >= 2**31 becomes negative)
    return (q << SHIFTS.to(torch.int64).to(q.device)).sum(dim=2).to(torch.int32)


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
    """The loading both formats share; subclasses say which way qweight's words run, and unpack."""

    name = "int4"
    packs_inputs = False  # qweight's eight values per word: down the inputs (GPTQ), or across

    def __init__(self, group_size: int, kernel: LinearKernel = INT4) -> None:
        super().__init__(kernel)
        self.group_size = group_size

    def group(self, layer: nn.Module) -> int:
        return layer.input_size if self.group_size == -1 else self.group_size

    def create_weights(self, layer: nn.Module) -> None:
        k, n, g = layer.input_size, layer.output_size, self.group(layer)
        if n % 8 or k % g or (self.packs_inputs and k % 8):
            raise ValueError(f"{self.name}: a {k} -> {n} linear layer does not fit 8-value words "
                             f"and {g}-input groups")
        add_weight(layer, "qweight", (k // 8, n) if self.packs_inputs else (k, n // 8), torch.int32,
                   Layout(output_dim=1, input_dim=0, packed_dim=0 if self.packs_inputs else 1,
                          pack_factor=8))
        add_weight(layer, "qzeros", (k // g, n // 8), torch.int32,
                   Layout(output_dim=1, input_dim=0, packed_dim=1, pack_factor=8))
        add_weight(layer, "scales", (k // g, n), torch.float32, Layout(output_dim=1, input_dim=0))

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


def check_config(name: str, bits: int, group: int, where: str) -> None:
    """The settings both formats' configs refuse alike: anything but 4 bits, odd group sizes."""
    if bits != 4:
        raise ValueError(f"{where}: {bits}-bit {name} is not supported (only 4-bit)")
    if group != -1 and (group < 8 or group % 8):
        raise ValueError(f"{where}: {name} group_size {group} is not supported (-1 or a multiple "
                         "of 8)")
