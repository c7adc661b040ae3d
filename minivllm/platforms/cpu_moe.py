"""The cpu platform's MoE experts: visit only the experts this batch chose, and count their bytes.

Decode on a CPU is bound by reading weights. A MoE layer holds E experts but a batch of T tokens
routes to at most T * k of them, so the step should read only those: the list of used experts is
taken from the per-expert counts once (`nonzero`), and the loop runs over it alone, never touching
an unchosen expert's weights (nor paying a Python iteration for it: Qwen3-MoE has 128 experts,
a decode token uses 8). `expert_bytes_read` says how much that saves at a given batch.
"""

from __future__ import annotations

import torch

from minivllm.model.moe import ExpertOrder, expert_mlp


def chosen_experts(hidden: torch.Tensor, weights: torch.Tensor, order: ExpertOrder,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as model/moe.py's `grouped_experts`, reading only the chosen experts' weights."""
    token_of_row = order.token_of_row
    rows = hidden[token_of_row]
    row_weight = weights.reshape(-1)[order.pair_order].to(hidden.dtype).unsqueeze(-1)
    counts = order.offsets[1:] - order.offsets[:-1]
    used = torch.nonzero(counts).flatten().tolist()
    starts = order.offsets.tolist()
    out_rows = torch.empty_like(rows)
    for expert in used:
        block = slice(starts[expert], starts[expert + 1])
        out_rows[block] = expert_mlp(rows[block], expert, gate_up_proj, down_proj, gate_up_scale,
                                     down_scale)
    return torch.zeros_like(hidden).index_add_(0, token_of_row, out_rows * row_weight)


def expert_bytes_read(order: ExpertOrder, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor) -> tuple[int, int]:
    """(bytes of expert weights a step reads, bytes of all expert weights) for one layer."""
    per_expert = (gate_up_proj[0].numel() * gate_up_proj.element_size()
                  + down_proj[0].numel() * down_proj.element_size())
    used = int(torch.count_nonzero(order.offsets[1:] - order.offsets[:-1]))
    return used * per_expert, gate_up_proj.shape[0] * per_expert
