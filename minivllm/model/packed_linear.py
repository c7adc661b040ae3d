"""CPU fast path: linear layers whose bf16 weights oneDNN has reordered once, at load time.

A plain `F.linear` on CPU hands oneDNN a row-major weight, which it must re-block for its bf16 (AVX512-BF16 /
AMX) kernels on every call. Reordering each weight once into oneDNN's blocked layout and calling its linear
primitive directly makes the model's matmuls about 1.5x faster at batch 1 and 64 on a 135M model (see
bench/RESULTS.md). The arithmetic is the same bf16 dot product with fp32 accumulation, so outputs match
`F.linear`. The readable model (model/llama.py) is untouched: the unquantized linear method
(minivllm/quantization/unquantized.py) reorders its weights with `reorder_weight` after loading and calls
`packed_linear`, only where `packing_applies` says so. `PackedLinear` does the same for a plain `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.cpu_platform import cpu_has_native_bf16


def packing_applies(device: str | torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU with native bf16 instructions, through a torch built with oneDNN's linear primitive."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and cpu_has_native_bf16()
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def reorder_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """W [out, in] bf16 -> the same values in oneDNN's blocked layout (an opaque tensor only oneDNN reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through oneDNN's linear primitive, W as `reorder_weight` left it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` through oneDNN, with W kept only in its reordered (opaque) layout.

    An untied weight is replaced (its Parameter now holds the packed copy, so parameter counts stay true);
    a weight tied to the embedding keeps the embedding's Parameter and adds the packed copy as a buffer.
    """

    def __init__(self, linear: nn.Linear, tied: bool, batch_hint: int) -> None:
        super().__init__()
        packed = reorder_weight(linear.weight, batch_hint)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if tied:
            self.weight = linear.weight  # still the embedding's
            self.register_buffer("packed_weight", packed, persistent=False)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "packed_weight", self.weight)
        return packed_linear(x, weight, self.bias)


def pack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Replace every `nn.Linear` in `model` by a PackedLinear; returns how many were replaced."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            setattr(parent, attr, PackedLinear(linear, id(linear.weight) in embedding_weights, batch_hint))
    return len(targets)
