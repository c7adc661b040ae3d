"""The CPU's float matmuls: each weight held once, in the layout its matmul reads fastest.

`TILED` (cpu_unquantized.cpp): tiles of 64 output rows, and in a tile, for each pair of inputs
(bf16) or each input (fp32), the 64 rows' weights side by side. A decode step reads one contiguous
stream per tile and each 64-byte load feeds 16 outputs with the input broadcast: close to the
machine's read bandwidth, where oneDNN reached about half (batch-1 matmuls 1.2-1.4x faster). Larger
batches use the same layout, each tile staying in L2 while every group of four rows multiplies it:
as fast as oneDNN's blocked GEMM up to a few hundred rows. Past TILED_MAX_ROWS (prompts) the weight
is unpacked for the one call and MKL's GEMM multiplies it: the copy is cheap beside M x N x K flops,
and at 1024-2048 rows it measured 1.05-1.1x oneDNN's speed where the tiles reached 0.77-0.99x
(bench/RESULTS.md has the numbers). Needs AVX-512 or AVX2 with FMA (the same loop over 16 lanes
held in two registers); bf16 pairs multiply with AVX512-BF16's vdpbf16ps where the CPU has it, else
as two fp32 fused multiply-adds (a bf16 widens by a shift). With AVX2's 16 registers a pass takes
one row of x, not four; several fp32 rows go in blocks of 6 rows x 16 outputs held in 12
registers, the usual shape of an AVX2 GEMM's inner kernel. On a Zen 3 batch 1 ran 1.5x faster than
with oneDNN's fp32 layout (a 135M Llama's step 45 -> 29 ms); against MKL's GEMM (batched over
the tiles in place, or on the plain weight) the blocks ran 1.25-2.1x faster at 9-16 rows and
0.9-1.4x at 64 (bench/RESULTS.md, session 22).

`ONEDNN`, elsewhere: oneDNN's blocked layout, reordered once (a plain `F.linear` on CPU re-blocks a
bf16 weight on every call: about 1.5x slower). An LM head tied to the embedding keeps the plain
weight (an embedding cannot look rows up in oneDNN's opaque layout), and `F.linear`.

The cpu platform (minivllm/platforms/cpu.py) picks one; MINIVLLM_CPU_SMALL_LINEAR=0 rules `TILED`
out. Sums are fp32, ordered unlike `F.linear`'s: results differ in the last bits, as between batch
sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.quantization.base import TILES, NativePart
from minivllm.quantization.unquantized import FloatKernel

TILE = 64  # output rows per tile (cpu_unquantized.cpp's kTile)
TILED_MAX_ROWS = 512  # beyond, unpack and F.linear: measured crossover between 256 and 1024 rows


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 64), K / pack, 64, pack] (pack 2 for bf16, 1 for fp32), zero-padded."""
    return torch.ops.minivllm_cpu.pack_small_linear(weight.detach())


def unpack_tiles(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_tiles: W [n, k], exactly."""
    tiles, steps, _, pack = tiled.shape
    return tiled.transpose(1, 2).reshape(tiles * TILE, steps * pack)[:n, :k]


def tiled_linear(x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None,
                 n: int) -> torch.Tensor:
    """x @ W.T + b, W as `pack_tiles` left it. The op's one overload is called directly: the
    overload packet's Python lookup cost ~2 us on each of a decode step's ~120 calls."""
    return torch.ops.minivllm_cpu.small_linear.default(x, tiled, bias, n)


def register_fake() -> None:
    """tiled_linear's output shape for torch.compile (model/compiled.py); call after building."""
    torch.library.register_fake("minivllm_cpu::small_linear")(
        lambda x, tiled, bias, n: x.new_empty(*x.shape[:-1], n))


class TiledKernel(FloatKernel):
    def layout(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(pack_tiles(layer.weight), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= TILED_MAX_ROWS:
            return tiled_linear(x, layer.weight, bias, layer.output_size)
        return F.linear(x, self.plain(layer), bias)  # a prompt's rows: a plain copy for this call

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The op itself over the tiles; more rows (x [T, K]) as `apply` takes them."""
        op, tiled, bias, n = (torch.ops.minivllm_cpu.small_linear.default, layer.weight, layer.bias,
                              layer.output_size)
        return lambda x: (op(x, tiled, bias, n) if x.shape[0] <= TILED_MAX_ROWS
                          else self.apply(layer, x, bias))

    def native(self, layer: nn.Module) -> list[NativePart]:
        return [NativePart(TILES, layer.weight, 0, layer.output_size, TILED_MAX_ROWS)]

    def plain(self, layer: nn.Module) -> torch.Tensor:
        return unpack_tiles(layer.weight, layer.output_size, layer.input_size)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Row n lies in tile n // 64, lane n % 64 of every step: gathered without unpacking all."""
        rows = layer.weight[ids // TILE, :, ids % TILE, :]  # [T, K / pack, pack]
        return rows.reshape(*ids.shape, -1)[..., : layer.input_size]


def reorder_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """W [out, in] -> the same values in oneDNN's blocked layout (opaque: only oneDNN reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through oneDNN's linear primitive, W as `reorder_weight` left it."""
    if torch.compiler.is_compiling():
        return torch.ops.minivllm.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class OneDnnKernel(FloatKernel):
    def layout(self, layer: nn.Module) -> None:
        if not layer.tied:  # a tied head's weight is also the embedding's table: it stays plain
            layer.weight = nn.Parameter(reorder_weight(layer.weight), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.is_mkldnn:
            return packed_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def plain(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.to_dense() if layer.weight.is_mkldnn else layer.weight


TILED, ONEDNN = TiledKernel(), OneDnnKernel()


# packed_linear as one opaque op for torch.compile (model/compiled.py): inductor's own lowering of
# oneDNN's linear wants the weight frozen into the graph as a constant, where ours is an input
# shared by every layer's graph. Registered through torch.library directly: the custom_op
# decorator's wrapper costs ~40 us a call.
_LIB = torch.library.Library("minivllm", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear",  # any backend: the packed weight dispatches as MkldnnCPU
          lambda x, packed, bias: torch.ops.mkldnn._linear_pointwise(
              x, packed, bias, "none", [], ""), "CompositeExplicitAutograd")


@torch.library.register_fake("minivllm::packed_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])
