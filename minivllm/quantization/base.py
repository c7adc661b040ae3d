"""What every quantization format provides: a config (read before any weight) and a linear method.

A linear layer (model/linear.py) owns its shape, its bias and which dimension tensor parallelism
splits; it holds its weights through a *method*, which, as in vLLM, does three things:
`create_weights` registers the tensors the checkpoint gives (with their Layout, so the loader can
copy a fused layer's shards into place whatever the format), `process_weights_after_loading` turns
them into the format's plain form and hands them to its kernel's `layout`, and `apply` computes
y = x @ W.T + bias. The *kernel* is the hardware-dependent part: the layout the weights are held in
and the matmul that reads it. Each family has a readable torch kernel (unquantized.py, int8.py,
int4.py); a platform (minivllm/platforms/) hands the model its own `LinearKernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Which dims of a stored tensor run along the layer's outputs and inputs; packed_dim stores
    `pack_factor` values per element; optional: a checkpoint may omit it (GPTQ's g_idx)."""

    output_dim: int | None
    input_dim: int | None
    packed_dim: int | None = None
    pack_factor: int = 1
    optional: bool = False


def add_weight(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               layout: Layout) -> None:
    """Register an empty parameter, its layout kept by the layer (module.to() replaces parameter
    objects: an attribute set on the parameter would not survive it)."""
    empty = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    layer.register_parameter(name, empty)
    layer.layouts[name] = layout


TILES, GGUF_BLOCKS = 0, 1  # NativePart.layout: model/cpu_decoder_layer.cpp's kTiled and kGguf


class NativePart(NamedTuple):
    """A decode step's matmul as C++ code calls it (the cpu platform's decoder layer,
    model/cpu_decoder_layer.cpp): which kernel reads the weight (`layout`: TILES or GGUF_BLOCKS),
    the weight as held, GGUF's `kernel_type` (0 for tiles), its outputs, and the most rows of x that
    kernel takes (more go through `apply`). A fused layer whose shards differ in format has one part
    per shard, their outputs side by side."""

    layout: int
    weight: torch.Tensor
    kernel_type: int
    outputs: int
    most_rows: int


class LinearKernel:
    """How one format family's weights are laid out and multiplied: `layout` once after loading
    (it may swap in another layout of the same values, never add a copy), `apply` per call."""

    def layout(self, layer: nn.Module) -> None:  # the readable kernels keep the plain tensors
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> x @ W.T + bias for a decode step's few rows, over the tensors `layer` holds now:
        for a hot loop that looks them up once (model/cpu_bound_layer.py). A kernel whose op can
        be called directly returns that call; by default, `apply`."""
        return lambda x: self.apply(layer, x, layer.bias)

    def native(self, layer: nn.Module) -> list[NativePart] | None:
        """The layer's matmul as C++ code can call it, or None (by default: only Python can)."""
        return None


class LinearKernels(NamedTuple):
    """One kernel per format family: what a platform hands the linear layers."""

    float: LinearKernel  # unquantized.py: W [N, K] as the checkpoint has it
    int8: LinearKernel  # int8.py: q [N, K] int8 and one scale per output
    int4: LinearKernel  # int4.py: GPTQ and AWQ, 4-bit groups
    # GGUF's blocks as the file stores them (cpu_gguf.py); None: a GGUF file is dequantized at load
    gguf: LinearKernel | None = None


class LinearMethod:
    """The interface every format implements (unquantized.py is the plainest)."""

    def __init__(self, kernel: LinearKernel) -> None:
        self.kernel = kernel

    def create_weights(self, layer: nn.Module) -> None:
        """The float W [N, K] as the checkpoint has it (unquantized; int8 quantizes it after)."""
        shape = (layer.output_size, layer.input_size)
        add_weight(layer, "weight", shape, torch.float32, Layout(output_dim=0, input_dim=1))

    def load_weight(self, layer: nn.Module, name: str, loaded: torch.Tensor, shard: int | None,
                    where: str) -> bool:
        """Copy a checkpoint tensor in where the layer's own slicing cannot (gguf.py's shards of
        different types); False: the layer slices it into place (model/linear.py)."""
        return False

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # all tensors in place
        self.kernel.layout(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel.apply(layer, x, bias)

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> x @ W.T + bias for a decode step's few rows (model/cpu_bound_layer.py)."""
        return self.kernel.bind(layer)

    def native(self, layer: nn.Module) -> list[NativePart] | None:
        """The layer's matmul as C++ code can call it (model/cpu_decoder_layer.cpp), or None."""
        return self.kernel.native(layer)

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights take once processed, bias excluded (chapter 12's table)."""
        tensors = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for name, t in tensors if name != "bias")


@dataclass(frozen=True)
class QuantizationConfig:
    """A quantized format's settings, from config.json or `quantization=` (float weights: None)."""

    name = "none"

    def linear_method(self, kernels: LinearKernels) -> LinearMethod:
        raise NotImplementedError
