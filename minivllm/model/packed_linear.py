"""CPU fast path: linear layers whose bf16 or fp32 weights oneDNN has reordered once, at load time.

A plain `F.linear` on CPU hands oneDNN a row-major weight, which it must re-block for its bf16 (AVX512-BF16 /
AMX) kernels on every call. Reordering each weight once into oneDNN's blocked layout and calling its linear
primitive directly makes the model's matmuls about 1.5x faster at batch 1 and 64 on a 135M model (see
bench/RESULTS.md). The arithmetic is the same bf16 dot product with fp32 accumulation, so outputs match
`F.linear`. In fp32 (where `F.linear` goes to MKL) the blocked weights made a batch-1 step 1.5x faster on a
2-core AVX-512 machine without AMX; sums are ordered differently, so results differ from `F.linear` in the
last bits (about 1e-6 relative), as they do between batch sizes. The readable model (model/llama.py) is
untouched: the unquantized linear method (minivllm/quantization/unquantized.py) reorders its weights with
`reorder_weight` after loading and calls `packed_linear`, only where `packing_applies` says so; decode-sized
calls go to model/small_linear.py instead, where it applies.
"""

from __future__ import annotations

import torch

from minivllm.cpu_platform import cpu_has_native_bf16


def packing_applies(device: str | torch.device, dtype: torch.dtype) -> bool:
    """fp32, or bf16 on a CPU with native bf16 instructions, through a torch built with oneDNN's linear primitive."""
    return (torch.device(device).type == "cpu" and (dtype == torch.float32 or dtype == torch.bfloat16
                                                     and cpu_has_native_bf16())
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def reorder_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """W [out, in] bf16 -> the same values in oneDNN's blocked layout (an opaque tensor only oneDNN reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in its ordinary row-major layout, for code that reads values back (a chapter's table, an
    exercise's checker): a packed weight is reordered back, exactly, since oneDNN only moved the values."""
    return weight.to_dense() if weight.is_mkldnn else weight


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through oneDNN's linear primitive, W as `reorder_weight` left it."""
    if torch.compiler.is_compiling():
        return torch.ops.minivllm.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")



# packed_linear as one opaque op for torch.compile (model/compiled.py): inductor's own lowering of oneDNN's linear
# wants the weight frozen into the graph as a constant, where ours is an input shared by every layer's graph.
# Registered through torch.library directly: the custom_op decorator's wrapper costs ~40 us a call.
_LIB = torch.library.Library("minivllm", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", lambda x, packed, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
          "CompositeExplicitAutograd")  # any backend: the packed weight dispatches as MkldnnCPU


@torch.library.register_fake("minivllm::packed_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])
