"""Float weights as the checkpoint has them: y = x @ W.T + b.

`FLOAT`, the readable kernel, keeps W [N, K] and calls `F.linear`; the CPU's (cpu_unquantized.py)
hold it in a faster layout, so `plain_weight` gives a reader W back and `rows` lets a tied embedding
look rows up in that layout: a weight shared by the embedding and the LM head is held once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import LinearKernel, LinearMethod


class FloatKernel(LinearKernel):
    """The readable kernel: W [N, K] as loaded, `F.linear`."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def plain(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K], row-major, as the checkpoint had it."""
        return layer.weight

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W: what an embedding tied to this layer looks up."""
        return F.embedding(ids, self.plain(layer))


FLOAT = FloatKernel()


class UnquantizedLinearMethod(LinearMethod):
    kernel: FloatKernel

    def __init__(self, kernel: FloatKernel = FLOAT) -> None:
        super().__init__(kernel)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.rows(layer, ids)


def plain_weight(layer: nn.Module) -> torch.Tensor:
    """A float layer's W [out, in] in its ordinary row-major layout, for code that reads values back
    (a chapter's table, an exercise's checker): a fast layout is unpacked, exactly."""
    return layer.quant_method.kernel.plain(layer)
