"""GPTQ 4-bit checkpoints in AutoGPTQ's layout (config.json: `quant_method == "gptq"`).

For K inputs, N outputs and groups of G inputs: qweight int32 [K/8, N] (eight 4-bit q per word
*down the inputs*), qzeros int32 [K/G, N/8] (packed *across the outputs*; format "gptq" (v1) stores
z - 1, "gptq_v2" z), scales fp16 [K/G, N], and g_idx int32 [K], the group of each input: k // G,
unless quantized in act-order (desc_act=True, inputs taken by decreasing importance).

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Act-order is honoured: sorting the inputs by g_idx makes each group contiguous again, so the weight
is stored in that order and each activation row is permuted the same way before the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.quantization.base import (
    Layout,
    LinearKernel,
    LinearKernels,
    LinearMethod,
    QuantizationConfig,
    add_weight,
)
from minivllm.quantization.int4 import Int4LinearMethod, check_config, unpack_cols, unpack_rows

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format values with this layout (v1: zero points - 1)


class GPTQLinearMethod(Int4LinearMethod):
    name, packs_inputs = "GPTQ", True

    def __init__(self, group_size: int, zeros_minus_one: bool, kernel: LinearKernel) -> None:
        super().__init__(group_size, kernel)
        self.zeros_minus_one = zeros_minus_one

    def create_weights(self, layer: nn.Module) -> None:
        super().create_weights(layer)
        add_weight(layer, "g_idx", (layer.input_size,), torch.int32,
                   Layout(output_dim=None, input_dim=0, optional=True))

    def unpack(self, layer: nn.Module):
        q = unpack_rows(layer.qweight.data)
        zeros = unpack_cols(layer.qzeros.data) + (1 if self.zeros_minus_one else 0)
        default = torch.arange(layer.input_size, device=q.device) // self.group(layer)
        loaded = any(name == "g_idx" for name, _ in layer.loaded)
        g_idx = layer.g_idx.data.long() if loaded else default
        if torch.equal(g_idx, default):
            return q, zeros, layer.scales.data, None
        perm = torch.argsort(g_idx, stable=True)  # act-order: put each group's inputs back together
        if not torch.equal(g_idx[perm], default):
            raise ValueError(f"GPTQ: g_idx does not put exactly {self.group(layer)} inputs in each "
                             "group")
        return q[perm], zeros, layer.scales.data, perm


@dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    group_size: int = 128
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    name = "gptq"

    @classmethod
    def from_hf(cls, qc: dict, where: str) -> GPTQConfig:
        bits, group = qc.get("bits", 4), qc.get("group_size", 128)
        fmt = qc.get("checkpoint_format") or "gptq"
        check_config("GPTQ", bits, group, where)
        if fmt not in FORMATS:
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported "
                             f"(supported: {FORMATS}); marlin- and bitblas-repacked checkpoints "
                             "have another layout")
        if qc.get("dynamic"):
            raise ValueError(f"{where}: GPTQ 'dynamic' per-module settings are not supported")
        return cls(group, bool(qc.get("desc_act", False)), fmt)

    def linear_method(self, kernels: LinearKernels) -> LinearMethod:
        return GPTQLinearMethod(self.group_size, self.checkpoint_format == "gptq", kernels.int4)
