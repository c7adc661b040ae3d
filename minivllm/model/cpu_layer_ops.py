"""The CPU fast path's fused layer ops: cpu_layer_ops.cpp (built by platforms/cpu_extension.py).

Why: a batch-1 bf16 decode step of a 135M Llama spent ~10 of its ~24 ms outside the matmuls, in ~100
small aten ops per layer (RMSNorm is seven, rotary a dozen, SwiGLU's activation three) and their
dispatch. Here each chain is one op. They stand in for the same functions the Triton backend brings
(minivllm/kernels/: `rms_norm`, `apply_rotary`, `silu_and_mul`, the same contracts, except that
rotary works in place), and round where the readable model rounds, so bf16 results equal its
results (fp32 ones within ~1 ulp). Measured on a 2-core AMD EPYC: ~50 dispatched ops a layer become
21, and that batch-1 step went from 25 to 19 ms (bench/RESULTS.md).

The cpu platform (minivllm/platforms/cpu.py, which lists its switches) hands the model `OPS` in
place of the readable ones (layer_ops.py).
"""

from __future__ import annotations

import torch

from minivllm.model.layer_ops import LayerOps


def register_fakes() -> None:
    """The ops' output shapes, for torch.compile (model/compiled.py traces the layers through these
    ops); called once the extension is built."""
    fake = torch.library.register_fake
    fake("minivllm_cpu::rms_norm")(lambda x, weight, eps: x.new_empty(x.shape))
    fake("minivllm_cpu::add_rms_norm")(
        lambda x, residual, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))
    fake("minivllm_cpu::rotary_embedding")(lambda positions, q, k, cos_sin: None)
    fake("minivllm_cpu::silu_and_mul")(
        lambda gate_up: gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, dim] or [T, heads, dim] (q/k norm) -> (norm(x), None); with `residual` [T, dim]:
    (norm(x + residual), x + residual)."""
    if residual is None:
        return torch.ops.minivllm_cpu.rms_norm.default(x, weight, eps), None
    return torch.ops.minivllm_cpu.add_rms_norm.default(x, residual, weight, eps)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, dim], k [T, kv_heads, dim] rotated in place to `positions` [T] (by the fp32
    table `cos_sin` [max_positions, 2, dim]); returns them."""
    torch.ops.minivllm_cpu.rotary_embedding.default(positions, q, k, cos_sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate first) -> silu(gate) * up, [T, I]."""
    return torch.ops.minivllm_cpu.silu_and_mul.default(gate_up)


OPS = LayerOps(rms_norm=rms_norm, rotary=apply_rotary, silu_and_mul=silu_and_mul)
