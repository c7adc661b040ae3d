"""What every quantization format provides: a config (parsed before any weight is read) and a linear method.

A linear layer (minivllm/model/linear.py) owns its shape, its bias and which dimension tensor parallelism
would split; it holds its weights through a *method*, which says three things, as in vLLM:

* `create_weights(layer)`: which tensors the checkpoint gives for this layer (`weight`, or `qweight`,
  `scales`, ...), registered as parameters with their shapes and which of their dims run along the layer's
  outputs and inputs (and how many values one stored element packs), so that the layer's loader can copy a
  fused layer's shards (q/k/v, gate/up) into place whatever the format;
* `process_weights_after_loading(layer)`: turn what was loaded into what the kernels want (quantize a
  float weight to int8, unpack 4-bit words into torch's int4 layout, reorder for oneDNN);
* `apply(layer, x, bias)`: y = x @ W.T + bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """How a stored tensor's dims map to the layer's [outputs, inputs] (None: not along that one).

    packed_dim/pack_factor: that dim stores `pack_factor` values per element (eight 4-bit values per int32).
    optional: a checkpoint may leave it out (GPTQ's g_idx): the method fills in a default.
    """

    output_dim: int | None
    input_dim: int | None
    packed_dim: int | None = None
    pack_factor: int = 1
    optional: bool = False


def add_weight(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, layout: Layout) -> None:
    """Register an empty parameter `name` on `layer`, with its layout kept by the layer (module.to() and
    to_empty() replace parameter objects, so attributes set on a parameter would not survive them)."""
    layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
    layer.layouts[name] = layout


class LinearMethod:
    """The interface every format implements (unquantized.py is the plainest)."""

    # buffers holding the same weight again in another layout, for speed (unquantized.py on a CPU): memory the
    # engine spends, but not part of the format, so weight_bytes leaves them out and layout_copy_bytes counts them
    layout_copies: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every checkpoint tensor is in place (and the layer is on its device)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights take once processed (bias and layout copies excluded): what the chapter's
        table counts."""
        return sum(t.numel() * t.element_size() for name, t in _tensors(layer)
                   if name != "bias" and name not in self.layout_copies)


def _tensors(layer: nn.Module):
    yield from layer.named_parameters(recurse=False)
    yield from layer.named_buffers(recurse=False)


@dataclass(frozen=True)
class QuantizationConfig:
    """A format's settings, from config.json's `quantization_config` or from `quantization=`; this base is
    float weights."""

    name = "none"

    def linear_method(self, triton: bool) -> LinearMethod:
        """The method for one linear layer; `triton`: launch Triton kernels (the model's Triton backend)
        rather than torch's own ops."""
        from minivllm.quantization.unquantized import UnquantizedLinearMethod

        return UnquantizedLinearMethod(triton)
