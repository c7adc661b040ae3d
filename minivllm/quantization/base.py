"""What every quantization format provides: a config (read before any weight) and a linear method.

A linear layer (minivllm/model/linear.py) owns its shape, its bias and which dimension tensor
parallelism splits; it holds its weights through a *method*, which says three things, as in vLLM:

* `create_weights(layer)`: which tensors the checkpoint gives for this layer (`weight`, or
  `qweight`, `scales`, ...), registered as parameters with their shapes and which of their dims run
  along the layer's outputs and inputs (and how many values one stored element packs), so that the
  layer's loader can copy a fused layer's shards (q/k/v, gate/up) into place whatever the format;
* `process_weights_after_loading(layer)`: turn what was loaded into the format's plain form
  (quantize a float weight to int8, unpack 4-bit words), then hand it to its kernel's `layout`;
* `apply(layer, x, bias)`: y = x @ W.T + bias, through its kernel.

The *kernel* (a `LinearKernel`) is the part that depends on the hardware: the layout the weights are
held in and the matmul that reads it. Each format family has a readable torch kernel beside it
(unquantized.py, int8.py, int4.py); a platform (minivllm/platforms/) hands the model its own
`LinearKernels`, one per family. A fast layout replaces the plain one: every weight is held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """How a stored tensor's dims map to the layer's [outputs, inputs] (None: not along that one).
    packed_dim/pack_factor: that dim stores `pack_factor` values per element (eight 4-bit values per
    int32). optional: a checkpoint may leave it out (GPTQ's g_idx): the method fills a default."""

    output_dim: int | None
    input_dim: int | None
    packed_dim: int | None = None
    pack_factor: int = 1
    optional: bool = False


def add_weight(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               layout: Layout) -> None:
    """Register an empty parameter `name` on `layer`, its layout kept by the layer (module.to() and
    to_empty() replace parameter objects: attributes set on a parameter would not survive them)."""
    empty = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    layer.register_parameter(name, empty)
    layer.layouts[name] = layout


class LinearKernel:
    """How one format family's weights are laid out and multiplied: `layout` once after loading
    (it may swap in another layout of the same values, never add a copy), `apply` per call."""

    def layout(self, layer: nn.Module) -> None:
        """Replace the plain tensors by the ones `apply` reads; the readable kernels keep them."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class LinearKernels(NamedTuple):
    """One kernel per format family: what a platform hands the linear layers."""

    float: LinearKernel  # unquantized.py: W [N, K] as the checkpoint has it
    int8: LinearKernel  # int8.py: q [N, K] int8 and one scale per output
    int4: LinearKernel  # int4.py: GPTQ and AWQ, 4-bit groups


class LinearMethod:
    """The interface every format implements (unquantized.py is the plainest)."""

    def __init__(self, kernel: LinearKernel) -> None:
        self.kernel = kernel

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every checkpoint tensor is in place (and the layer is on its device)."""
        self.kernel.layout(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.apply(layer, x, bias)

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights take once processed, bias excluded (chapter 12's table)."""
        tensors = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for name, t in tensors if name != "bias")


@dataclass(frozen=True)
class QuantizationConfig:
    """A quantized format's settings, from config.json or `quantization=` (float weights: None)."""

    name = "none"

    def linear_method(self, kernels: LinearKernels) -> LinearMethod:
        """The method for one linear layer, running the platform's kernel for its family."""
        raise NotImplementedError
