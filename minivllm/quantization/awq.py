"""AWQ 4-bit checkpoints (config.json: `quantization_config.quant_method == "awq"`, version "gemm").

For K inputs, N outputs and groups of G inputs, AutoAWQ's GEMM layout holds qweight int32 [K, N/8]
and qzeros int32 [K/G, N/8] (zero points as they are), eight 4-bit values per word packed *across
the outputs* in the order 0, 2, 4, 6, 1, 3, 5, 7, and scales fp16 [K/G, N]:
W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]. The interleaved order suits AWQ's CUDA kernel,
which converts pairs of nibbles to fp16 with bit tricks; here the words are unpacked and reordered
once at load, into the layout every 4-bit kernel reads (int4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.quantization.base import LinearKernels, LinearMethod, QuantizationConfig
from minivllm.quantization.int4 import Int4LinearMethod, check_config, unpack_cols

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds output ORDER[i] of its group of eight
REVERSE = tuple(ORDER.index(j) for j in range(8))  # output j sits in nibble REVERSE[j]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's order -> int32 [R, 8C], outputs in their natural order."""
    nibbles = unpack_cols(packed).reshape(packed.shape[0], -1, 8)
    return nibbles[:, :, list(REVERSE)].reshape(packed.shape[0], -1)


class AWQLinearMethod(Int4LinearMethod):
    name = "AWQ"

    def unpack(self, layer: nn.Module):
        q, z = unpack_awq(layer.qweight.data), unpack_awq(layer.qzeros.data)
        return q, z, layer.scales.data, None


@dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    group_size: int = 128
    name = "awq"

    @classmethod
    def from_hf(cls, qc: dict, where: str) -> AWQConfig:
        bits = qc.get("bits", qc.get("w_bit", 4))
        group = qc.get("group_size", qc.get("q_group_size", 128))
        version = str(qc.get("version", "gemm")).lower()
        check_config("AWQ", bits, group, where)
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported (supported: "
                             "'gemm', AutoAWQ's default layout); gemv, exllama, marlin and ipex "
                             "variants store other layouts")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}: AWQ without zero points is not supported")
        skipped = [m for m in qc.get("modules_to_not_convert") or []
                   if "lm_head" not in m and "embed" not in m]
        if skipped:
            raise ValueError(f"{where}: AWQ modules_to_not_convert {skipped} is not supported "
                             "(only the LM head and embeddings stay float here)")
        return cls(group)

    def linear_method(self, kernels: LinearKernels) -> LinearMethod:
        return AWQLinearMethod(self.group_size, kernels.int4)
