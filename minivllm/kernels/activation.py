"""SwiGLU's activation in one pass: silu(gate) * up, reading the fused gate/up projection once.

In torch it is a SiLU kernel and a multiply, each reading and writing [T, intermediate] activations.
One program per (token, column tile) here loads both halves of its gate_up row, writes the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_gt, stride_ot, intermediate,
                         BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    row = gate_up_ptr + t.to(tl.int64) * stride_gt
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, (silu * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_config(intermediate: int, block: int = 1024) -> dict:
    """Constexprs, shared with the ahead-of-time compile test (tests/test_aot_compile.py)."""
    return dict(BLOCK=min(block, triton.next_power_of_2(intermediate)))


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate half first, as fused) -> silu(gate) * up, [T, I]."""
    assert gate_up.stride(-1) == 1 and gate_up.shape[-1] % 2 == 0
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        config = silu_and_mul_config(intermediate, block)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, config["BLOCK"]))](
            gate_up, out, gate_up.stride(0), out.stride(0), intermediate, **config)
    return out
