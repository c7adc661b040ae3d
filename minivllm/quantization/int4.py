"""What GPTQ and AWQ share: 4-bit weights with a scale and a zero point per group of G inputs.

Both formats store, for W [N outputs, K inputs] (transposed here to [K, N], as their kernels read it), a
4-bit q in 0..15, and per group of G consecutive inputs and per output a zero point z and a scale s:

    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]

eight q (or z) per int32 word. They differ only in which way the words run and in what order the eight
nibbles sit (gptq.py, awq.py); each format's `unpack` returns plain q, z, s, after which the two share
everything: once loaded, the weights are laid out for the kernel that will run them:

* CPU, bf16/fp16: torch's `_weight_int4pack_mm_for_cpu` (weights in its own packed layout, [N, K/2] bytes,
  and per group a scale and an offset: W = (q - 8) * s + (8 - z) * s, the same numbers regrouped). In fp32
  that kernel is a slow reference loop (10-100x slower than fp32 `F.linear` at 16 rows, measured in
  bench/RESULTS.md), so fp32 dequantizes and multiplies instead, exactly as the checkpoint defines W;
* GPU (the Triton backend): minivllm/kernels/int4_linear.py, which reads q packed eight to a word along K
  (GPTQ's own layout), z as bytes and s, and dequantizes each tile in registers;
* anywhere else (the torch reference on a GPU, groups the CPU kernel does not take): dequantize, then matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import LinearMethod

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of a word sits at bits 4i..4i+3
CPU_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # where it is the fast path (see above)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word down the rows -> int32 [8R, C] (row 8r + i = nibble i of row r)."""
    nibbles = (packed[:, None, :] >> SHIFTS.to(packed.device)[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C], eight nibbles per word across the columns -> int32 [R, 8C] (col 8c + i = nibble i)."""
    return ((packed[:, :, None] >> SHIFTS.to(packed.device)) & 0xF).reshape(packed.shape[0], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32 (words >= 2**31 become negative)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_rows: [8R, C] values in 0..15 -> int32 [R, C]."""
    q = q.to(torch.int64).reshape(-1, 8, q.shape[1])
    return _to_int32((q << SHIFTS.to(torch.int64).to(q.device)[None, :, None]).sum(dim=1))


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_cols: [R, 8C] values in 0..15 -> int32 [R, C]."""
    q = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    return _to_int32((q << SHIFTS.to(torch.int64).to(q.device)).sum(dim=2))


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [K, N], zeros and scales [K/G, N] -> W.T [K, N] in fp32: (q - z) * s, group by group."""
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    return (q.to(torch.float32) - z) * scales.to(torch.float32).repeat_interleave(group_size, dim=0)


class Int4LinearMethod(LinearMethod):
    """The loading and the matmul both formats share; subclasses declare their tensors and unpack them."""

    def __init__(self, group_size: int, triton: bool = False) -> None:
        self.group_size, self.triton = group_size, triton

    def group(self, layer: nn.Module) -> int:
        return layer.input_size if self.group_size == -1 else self.group_size

    def unpack(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [K, N], z [K/G, N], s [K/G, N], perm or None): with perm, input k of the unpacked weight is
        input perm[k] of the layer (GPTQ's act-order), so x[:, perm] is what multiplies it."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, zeros, scales, perm = self.unpack(layer)
        for name in list(layer.layouts):
            if name != "bias":
                delattr(layer, name)
        group, dtype = self.group(layer), scales.dtype
        layer.perm = perm
        keep = lambda name, t: layer.register_buffer(name, t.contiguous(), persistent=False)  # noqa: E731
        n = layer.output_size
        cpu = q.device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and group in CPU_GROUP_SIZES and n % 16 == 0
        layer.kernel = "triton" if self.triton and group % 16 == 0 else "cpu" if cpu else "torch"
        if layer.kernel == "cpu":
            keep("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous(), 1))
            s = scales.float()
            keep("scales_and_zeros", torch.stack([s, (8 - zeros.float()) * s], dim=-1).to(dtype))
        else:
            keep("qweight", pack_rows(q))  # [K/8, N] int32, as GPTQ stores it
            keep("zeros", zeros.to(torch.uint8))
            keep("scales", scales)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.perm is not None:
            x = x[:, layer.perm]
        group = self.group(layer)
        if layer.kernel == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), layer.qweight, group,
                                                           layer.scales_and_zeros)
        elif layer.kernel == "triton":
            from minivllm.kernels.int4_linear import int4_linear

            return int4_linear(x, layer.qweight, layer.zeros, layer.scales, group, bias)
        else:
            w = dequantize(unpack_rows(layer.qweight), layer.zeros, layer.scales, group)
            y = F.linear(x, w.T.to(x.dtype))
        return y if bias is None else y + bias
