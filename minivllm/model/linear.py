"""Linear layers whose weights are held by a quantization method: y = x @ W.T + b, W [outputs, inputs].

The layer owns what does not depend on the format: its sizes, its bias, the list of shards a fused layer
concatenates along its outputs (q/k/v, gate/up), and `shard_dim`, the dimension of W that tensor parallelism
splits across GPUs: 0 for a column layer (each GPU computes some outputs: q/k/v, gate/up), 1 for a row layer
(each GPU holds some inputs and the partial sums are added up: o_proj, down_proj). The method
(minivllm/quantization/) owns the weight tensors themselves: which ones, their dtype, and the matmul.

Loading goes through `weight_loader`: a checkpoint tensor for one shard lands in its slice of each
parameter along that parameter's output dim (scaled down where that dim packs several values per element).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.quantization.base import Layout, LinearMethod, QuantizationConfig, add_weight


class LinearBase(nn.Module):
    shard_dim: int  # the dim of W [outputs, inputs] tensor parallelism splits

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant: QuantizationConfig | None = None,
                 triton: bool = False, method: LinearMethod | None = None) -> None:
        super().__init__()
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(self.output_sizes)
        self.tied = False  # the weight is the embedding's (see tie_to)
        self.layouts: dict[str, Layout] = {}  # each parameter's dims, as create_weights declared them
        self.quant_method = method or (quant or QuantizationConfig()).linear_method(triton)
        self.quant_method.create_weights(self)
        if bias:
            add_weight(self, "bias", (self.output_size,), torch.float32, Layout(output_dim=0, input_dim=None))
        else:
            self.register_parameter("bias", None)
        self.loaded: set[tuple[str, int | None]] = set()  # (parameter, shard) pairs copied in so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Share the embedding's [vocab, hidden] weight (float methods only: embeddings are never quantized)."""
        self.weight, self.tied = embedding.weight, True

    @property
    def shards(self) -> list[int | None]:
        """What a checkpoint tensor for this layer may name: None (an unfused layer) or each fused shard."""
        return [None] if len(self.output_sizes) == 1 else list(range(len(self.output_sizes)))

    def expected(self) -> set[tuple[str, int | None]]:
        """Every (parameter, shard) a complete checkpoint fills."""
        return {(name, shard) for name, layout in self.layouts.items() if not layout.optional
                and not (self.tied and name == "weight") for shard in self.shards}

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: int | None, where: str = "") -> None:
        """Copy one checkpoint tensor into parameter `name`, into `shard`'s rows of a fused layer."""
        layout = self.layouts[name]
        target, dim, factor = getattr(self, name).data, layout.output_dim, layout.pack_factor
        if shard is not None and dim is not None:
            size, offset = self.output_sizes[shard], sum(self.output_sizes[:shard])
            if layout.packed_dim == dim:  # e.g. AWQ's qweight: eight outputs per int32
                if size % factor or offset % factor:
                    raise ValueError(f"{where}: a shard of {size} outputs does not fill whole {factor}-value words")
                size, offset = size // factor, offset // factor
            target = target.narrow(dim, offset, size)
        if target.dtype.is_floating_point != loaded.dtype.is_floating_point:
            raise ValueError(f"{where} is {loaded.dtype}, expected {target.dtype} (a checkpoint of another format?)")
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"{where} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        if shard is not None and dim is None and any(n == name for n, _ in self.loaded):
            if not torch.equal(target, loaded.to(target.dtype)):  # one tensor for every shard (GPTQ's g_idx)
                raise ValueError(f"{where} differs between the shards fused into one layer ({self.output_sizes})")
        with torch.no_grad():
            target.copy_(loaded)
        self.loaded.add((name, shard))

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)
        del self.loaded

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"method={type(self.quant_method).__name__}")


class ColumnLinear(LinearBase):
    """Outputs split across GPUs under tensor parallelism: q/k/v, gate/up, the LM head."""

    shard_dim = 0


class RowLinear(LinearBase):
    """Inputs split across GPUs under tensor parallelism (partial sums all-reduced): o_proj, down_proj."""

    shard_dim = 1
