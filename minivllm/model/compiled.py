"""CPU, opt-in: the work around attention in each decoder layer, compiled by torch.compile/inductor.

Why it was tried: an eager layer is some 200 small aten ops (RMSNorm alone is seven, rotary a
dozen), each a few microseconds of dispatch plus a pass over memory; inductor fuses each run of
elementwise ops and reductions between two matmuls into one C++ loop.

How, vLLM-CPU's way (piecewise): attention reads and writes the paged cache, so it stays eager; the
two pure parts of every layer around it, `before_attention` (residual add + norm, qkv, rotary) and
`after_attention` (o_proj, residual add + norm, gate/up, SiLU, down), are compiled, the same code
for every layer (dynamo treats a layer's weights as inputs: 30 layers cost the compile of one).
`dynamic=True` makes one graph serve every token count; dynamo still specialises a count of 1
(batch-1 decode) and the thread count (one per count the sizer picks): up to four graphs per piece,
each compiled when it first appears (tens of seconds on 2 cores) and cached on disk by inductor for
the next process.

Why it is off by default: on the 2-core AMD EPYC of bench/RESULTS.md it made decode steps 3-9%
slower. The fused kernels save less than the 60 compiled calls a step cost: each pays dynamo's guard
lookup (~30 us) and wrapper, where the eager ops they replace cost 1-2 us each. Paying off needs one
compiled call per step (the whole model, attention an opaque op). The cpu platform
(minivllm/platforms/cpu.py) applies it where MINIVLLM_CPU_COMPILE=1 (never with enforce_eager), only
for float weights (the unquantized method) without tensor parallelism: quantized layers keep their
own kernels, and collectives stay out of the graph. If compiling fails (no C++ compiler, an
unsupported op), the layers warn once and run eager from then on.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from minivllm.quantization.unquantized import UnquantizedLinearMethod

PIECES = ("before_attention", "after_attention")


def compile_decoder_layers(model: nn.Module) -> CompiledLayers | None:
    """Compile every decoder layer's before/after-attention parts in place; None where it can't."""
    linears = [m for m in model.modules() if hasattr(m, "quant_method")]
    if (getattr(model, "tp", None) is None or model.tp.size > 1
            or not all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in linears)):
        return None
    return CompiledLayers(list(model.model.layers))


class CompiledLayers:
    """Each layer's two pieces replaced by compiled ones (instance attributes shadow methods)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers, self.failed = layers, None  # failed: the error that sent them back to eager
        for layer in layers:
            for name in PIECES:
                setattr(layer, name, CompiledPiece(self, getattr(layer, name)))

    def restore_eager(self, error: Exception) -> None:
        """Back to the plain methods, for good (`error`: why, warned about once)."""
        if self.failed is None:
            warnings.warn(f"torch.compile failed, running the model eager: {type(error).__name__}: "
                          f"{error}", RuntimeWarning, stacklevel=3)
        self.failed = error
        for layer in self.layers:
            for name in PIECES:
                layer.__dict__.pop(name, None)

    @property
    def active(self) -> bool:
        return any(name in layer.__dict__ for layer in self.layers for name in PIECES)


class CompiledPiece:
    """One layer's piece: the compiled function, and the eager method it falls back to."""

    def __init__(self, owner: CompiledLayers, eager) -> None:
        self.owner, self.eager = owner, eager
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args):
        if args[1] is None:  # the first layer's missing residual: x + 0 is x, and it spares a graph
            args = (args[0], torch.zeros_like(args[0]), *args[2:])
        try:
            return self.compiled(*args)
        except Exception as error:  # noqa: BLE001  (the pieces are pure: eager recomputes them)
            self.owner.restore_eager(error)
            return self.eager(*args)
