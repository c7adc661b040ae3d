"""A mixture-of-experts feed-forward layer, computed the way serving engines compute it.

Each token asks a router which ``top_k`` of ``E`` experts (each a SwiGLU MLP) should see it. A naive
loop would run every expert on every token and mask; engines instead *sort* the (token, expert)
pairs by expert, run each expert once on its contiguous block of rows (one matrix multiply per
expert, the shape a grouped-GEMM kernel wants), then scatter the rows back and add them up weighted
by the router. This module is that computation in plain torch: the reference every fast path
(``kernels/fused_moe.py`` on CUDA, the chosen-experts path on CPU) is tested against.

Weights use the layout transformers 5.x keeps in memory: ``gate_up_proj`` ``[E, 2*I, H]`` (gate
rows first, then up rows) and ``down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, keep the ``top_k`` best, optionally rescale them to sum to 1.

    Mixtral always renormalises; Qwen3-MoE does when ``norm_topk_prob``; Qwen2-MoE does not.
    Returns ``(weights [T, k] fp32, expert_ids [T, k] int64)``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


@dataclass(frozen=True)
class ExpertOrder:
    """The (token, slot) pairs of a step sorted by expert: the plan every MoE kernel follows.

    ``pair_order[j]`` is a flat index ``token * k + slot`` into the ``[T, k]`` routing tables, so
    the rows ``offsets[e]:offsets[e+1]`` of the sorted order all belong to expert ``e``.
    """

    pair_order: torch.Tensor   # [T*k] int64, flat (token, slot) indices grouped by expert
    offsets: torch.Tensor      # [E+1] int64, where each expert's block starts in pair_order
    top_k: int

    @property
    def token_of_row(self) -> torch.Tensor:
        """Which token each sorted row came from (rows are gathered from the hidden states)."""
        return self.pair_order // self.top_k

    def tokens_per_expert(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Group the flattened ``[T, k]`` choices by expert with a stable sort and count each group
    (with index_add_, not bincount, which asks the GPU for the largest id before it allocates)."""
    flat = expert_ids.reshape(-1)
    pair_order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    return ExpertOrder(pair_order, offsets, expert_ids.shape[1])


def expert_linear(rows: torch.Tensor, weight: torch.Tensor,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's block of rows times its weight ``[N, K]``; int8 weights (``scale``: one per
    output, quantization/int8.py's idea per expert) are multiplied as they are and scaled after."""
    out = F.linear(rows, weight.to(rows.dtype))  # every int8 value is exact in any float dtype
    return out if scale is None else out * scale


def expert_mlp(rows: torch.Tensor, expert: int, gate_up_proj: torch.Tensor,
               down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
               down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ``expert``'s SwiGLU MLP on its block of rows: down(silu(gate) * up)."""
    def scale(s: torch.Tensor | None) -> torch.Tensor | None:
        return None if s is None else s[expert]
    gate, up = expert_linear(rows, gate_up_proj[expert], scale(gate_up_scale)).chunk(2, dim=-1)
    return expert_linear(F.silu(gate) * up, down_proj[expert], scale(down_scale))


def grouped_experts(hidden: torch.Tensor, weights: torch.Tensor, order: ExpertOrder,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Run each expert once on its block of sorted rows, then scatter-add the weighted outputs.

    Empty experts are skipped: their weights are never read, which is why decode with few tokens
    touches only a small part of the expert weights. Int8 experts come with their scales
    (``[E, 2I]`` and ``[E, H]``); float ones without.
    """
    rows = hidden[order.token_of_row]                        # [T*k, H], grouped by expert
    row_weight = weights.reshape(-1)[order.pair_order]       # [T*k]
    out_rows = torch.empty_like(rows)
    bounds = order.offsets.tolist()
    for expert in range(len(bounds) - 1):
        start, end = bounds[expert], bounds[expert + 1]
        if start == end:
            continue
        out_rows[start:end] = expert_mlp(rows[start:end], expert, gate_up_proj, down_proj,
                                         gate_up_scale, down_scale)
    out = torch.zeros_like(hidden)
    out.index_add_(0, order.token_of_row, out_rows * row_weight.unsqueeze(-1).to(out_rows.dtype))
    return out


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert in one layer in one step: plain data the trace can hold."""

    layer: int
    tokens_per_expert: tuple[int, ...]

    @property
    def experts_used(self) -> int:
        return sum(1 for n in self.tokens_per_expert if n)


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Route, sort by expert, run the experts as blocks, combine: the sparse MLP on ``[T, H]``."""
    weights, expert_ids = route(router_logits, top_k, renormalize)
    order = sort_by_expert(expert_ids, gate_up_proj.shape[0])
    return grouped_experts(hidden, weights, order, gate_up_proj, down_proj)


class SparseMoeBlock(torch.nn.Module):
    """The MoE MLP of Mixtral / Qwen3-MoE / Qwen2-MoE, with transformers 5.x's parameter layout.

    ``shared_intermediate_size`` adds Qwen2-MoE's always-on shared expert, scaled per token by
    ``sigmoid(shared_expert_gate(x))``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.router = torch.nn.Linear(hidden_size, num_experts, bias=False)
        self.gate_up_proj = torch.nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size))
        self.shared = None
        if shared_intermediate_size:
            self.shared = torch.nn.ModuleDict({
                "gate_proj": torch.nn.Linear(hidden_size, shared_intermediate_size, bias=False),
                "up_proj": torch.nn.Linear(hidden_size, shared_intermediate_size, bias=False),
                "down_proj": torch.nn.Linear(shared_intermediate_size, hidden_size, bias=False),
                "gate": torch.nn.Linear(hidden_size, 1, bias=False)})

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = fused_moe(hidden, self.router(hidden), self.gate_up_proj, self.down_proj,
                        self.top_k, self.renormalize)
        if self.shared is not None:
            s = self.shared
            mlp = s["down_proj"](F.silu(s["gate_proj"](hidden)) * s["up_proj"](hidden))
            out = out + torch.sigmoid(s["gate"](hidden)) * mlp
        return out


# Per-expert checkpoint names (what transformers 5.x's save_pretrained writes, and hub checkpoints
# hold) for the gate, up and down projections: Mixtral's w1 / w3 / w2, the Qwen MoE families'.
EXPERT_WEIGHT_NAMES = {"mixtral": ("w1", "w3", "w2"),
                       "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                       "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def stack_expert_weights(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int,
                         family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``{prefix}.{e}.{name}.weight`` for every expert -> ``(gate_up_proj [E, 2I, H], down_proj
    [E, H, I])``, the layout this module computes with. A checkpoint already fused (3-D
    ``{prefix}.gate_up_proj`` / ``{prefix}.down_proj``) is returned as it is."""
    if f"{prefix}.gate_up_proj" in tensors:
        return tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"]
    gate, up, down = EXPERT_WEIGHT_NAMES[family]
    def each(name: str) -> list[torch.Tensor]:
        return [tensors[f"{prefix}.{e}.{name}.weight"] for e in range(num_experts)]
    gate_up = torch.stack([torch.cat(pair) for pair in zip(each(gate), each(up))])
    return gate_up, torch.stack(each(down))
