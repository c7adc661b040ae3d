"""Linear layers whose weights a quantization method holds: y = x @ W.T + b, W [outputs, inputs].

The layer owns what does not depend on the format: its sizes, its bias, the list of shards a fused
layer concatenates along its outputs (q/k/v, gate/up), and `shard_dim`, the dimension of W that
tensor parallelism splits across GPUs: 0 for a column layer (each GPU computes some outputs), 1 for
a row layer (each GPU holds some inputs and the partial sums are added up). The method
(minivllm/quantization/) owns the weight tensors themselves: which ones, their dtype, and, through
the kernel the platform handed it (`kernels`, the readable ones by default), their layout and the
matmul.

Loading goes through `weight_loader`: a checkpoint tensor for one shard lands in its slice of each
parameter along that parameter's output dim (scaled down where that dim packs several values per
element). Under tensor parallelism (`tp`, distributed/parallel.py) the layer is built at its rank's
size: a column layer holds 1/N of each fused shard's outputs (a shard may be replicated over
`replicas` ranks: KV heads fewer than the ranks), a row layer 1/N of the inputs and all-reduces its
partial sums. The method creates weights of that local shape and never hears of ranks;
`weight_loader` cuts the rank's slice out of the checkpoint tensor along whichever dim of it runs
along `shard_dim`.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel import SINGLE, TensorParallel, shard_of
from minivllm.quantization import REFERENCE_KERNELS, LinearKernels, QuantizationConfig
from minivllm.quantization.base import Layout, LinearMethod, add_weight
from minivllm.quantization.unquantized import UnquantizedLinearMethod


class LinearBase(nn.Module):
    shard_dim: int  # the dim of W [outputs, inputs] tensor parallelism splits
    # each subclass also defines local_sizes (the inputs, and outputs per shard, this rank holds)
    # and rank_slice(shard) (which slice of a checkpoint tensor, along shard_dim, this rank holds)

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 quant: QuantizationConfig | None = None,
                 kernels: LinearKernels = REFERENCE_KERNELS, method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE, replicas: list[int] | None = None) -> None:
        """Sizes are the whole layer's; `replicas[i]`: how many ranks hold the same slice of fused
        shard i. `method` (else `quant`'s, else float weights') runs the kernel `kernels` has for
        its family."""
        super().__init__()
        self.tp, self.replicas = tp, list(replicas or [1] * len(output_sizes))
        self.input_size, self.output_sizes = self.local_sizes(input_size, list(output_sizes))
        self.output_size = sum(self.output_sizes)
        self.tied = False  # the weight is the embedding's (see tie_to)
        self.layouts: dict[str, Layout] = {}  # each parameter's dims, as create_weights declared
        self.quant_method = method or (quant.linear_method(kernels) if quant is not None
                                       else UnquantizedLinearMethod(kernels.float))
        self.quant_method.create_weights(self)
        if bias:
            add_weight(self, "bias", (self.output_size,), torch.float32,
                       Layout(output_dim=0, input_dim=None))
        else:
            self.register_parameter("bias", None)
        self.loaded: set[tuple[str, int | None]] = set()  # (parameter, shard) pairs copied in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Share the embedding's [vocab, hidden] weight (float methods only: embeddings are never
        quantized)."""
        self.weight, self.tied = embedding.weight, True

    def expected(self) -> set[tuple[str, int | None]]:
        """Every (parameter, shard) a complete checkpoint fills; shard None in an unfused layer."""
        shards = [None] if len(self.output_sizes) == 1 else range(len(self.output_sizes))
        return {(name, shard) for name, layout in self.layouts.items() if not layout.optional
                and not (self.tied and name == "weight") for shard in shards}

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: int | None,
                      where: str = "") -> None:
        """Copy a checkpoint tensor into parameter `name` (into `shard`'s rows of a fused layer)."""
        if self.quant_method.load_weight(self, name, loaded, shard, where):
            self.loaded.add((name, shard))
            return
        layout = self.layouts[name]
        target, dim, factor = getattr(self, name).data, layout.output_dim, layout.pack_factor
        if shard is not None and dim is not None:
            size, offset = self.output_sizes[shard], sum(self.output_sizes[:shard])
            if layout.packed_dim == dim:  # e.g. AWQ's qweight: eight outputs per int32
                if size % factor or offset % factor:
                    raise ValueError(f"{where}: a shard of {size} outputs does not fill whole "
                                     f"{factor}-value words")
                size, offset = size // factor, offset // factor
            target = target.narrow(dim, offset, size)
        split = layout.output_dim if self.shard_dim == 0 else layout.input_dim
        if self.tp.size > 1 and split is not None:  # this rank's part of the checkpoint tensor
            loaded = shard_of(loaded, split, self.rank_slice(shard), target.shape[split])
        if target.dtype.is_floating_point != loaded.dtype.is_floating_point:
            raise ValueError(f"{where} is {loaded.dtype}, expected {target.dtype} (a checkpoint of "
                             f"another format?)")
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"{where} has shape {tuple(loaded.shape)}, expected "
                             f"{tuple(target.shape)}")
        # one tensor for every shard (GPTQ's g_idx): each shard's copy must be the same
        if (shard is not None and dim is None and any(n == name for n, _ in self.loaded)
                and not torch.equal(target, loaded.to(target.device, target.dtype))):
            raise ValueError(f"{where} differs between the shards fused into one layer "
                             f"({self.output_sizes})")
        with torch.no_grad():
            target.copy_(loaded)
        self.loaded.add((name, shard))

    def row_absmax(self, weight: torch.Tensor) -> torch.Tensor:
        """Each output row's max |w| over all its inputs (per-channel quantizers' scales)."""
        return weight.float().abs().amax(dim=1)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)
        del self.loaded

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"method={type(self.quant_method).__name__}")


class ColumnLinear(LinearBase):
    """Outputs split across GPUs under tensor parallelism: q/k/v, gate/up, the LM head. Each rank's
    outputs stay on it (the next layer wants them split: attention heads, a row layer's inputs)."""

    shard_dim = 0

    def local_sizes(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        n = self.tp.size
        for size, copies in zip(output_sizes, self.replicas):
            if (size * copies) % n:
                raise ValueError(f"tensor_parallel_size={n} does not divide a layer's {size} "
                                 f"outputs")
        return input_size, [size * copies // n for size, copies in zip(output_sizes, self.replicas)]

    def rank_slice(self, shard: int | None) -> int:
        return self.tp.rank // self.replicas[shard or 0]


class RowLinear(LinearBase):
    """Inputs split across GPUs under tensor parallelism (partial sums all-reduced): o_proj,
    down_proj."""

    shard_dim = 1

    def local_sizes(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        if input_size % self.tp.size:
            raise ValueError(f"tensor_parallel_size={self.tp.size} does not divide a layer's "
                             f"{input_size} inputs")
        return input_size // self.tp.size, output_sizes

    def rank_slice(self, shard: int | None) -> int:
        return self.tp.rank

    def row_absmax(self, weight: torch.Tensor) -> torch.Tensor:
        """The max over every rank's slice of the row: int8 under tensor parallelism keeps one
        process's scales."""
        return self.tp.all_reduce_max(super().row_absmax(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_r.T on this rank's inputs, then one all-reduce sums the ranks' partial outputs
        (bias added once)."""
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self.quant_method.apply(self, x, bias))
