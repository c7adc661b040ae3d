"""A MoE layer over ranks: tensor parallel cuts every expert, expert parallel deals them out.

Tensor parallel gives each rank a slice of every expert's intermediate dimension (its rows of gate
and of up, the matching columns of down), so each rank's output is a partial sum and one all-reduce
completes it, as for a dense MLP. Expert parallel gives each rank whole experts (contiguous ranges,
the first ``E % world`` ranks one more when E does not divide); a rank runs only the sorted rows of
its own experts, and the ranks' partial outputs are all-gathered and summed
(`expert_parallel_experts`, on a default process group). The engine's layer (model/moe_layer.py)
does the same sum as one all-reduce on its tensor-parallel group: every rank already holds every
token, so nothing needs dispatching first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minivllm.model.moe import ExpertOrder, grouped_experts


def tensor_parallel_shard(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, rank: int,
                          world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gate_up ``[E, 2*I/w, H]`` (its gate rows, then up rows), down ``[E, H, I/w]``."""
    inter = down_proj.shape[2]
    if inter % world:
        raise ValueError(f"intermediate size {inter} does not divide over {world} ranks")
    part = slice(rank * inter // world, (rank + 1) * inter // world)
    gate, up = gate_up_proj[:, :inter], gate_up_proj[:, inter:]
    return torch.cat([gate[:, part], up[:, part]], dim=1), down_proj[:, :, part].contiguous()


def expert_range(num_experts: int, rank: int, world: int) -> range:
    """The experts rank ``rank`` holds: contiguous, sizes differing by at most one."""
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def local_order(order: ExpertOrder, experts: range) -> ExpertOrder:
    """The part of the sorted routing that falls on ``experts``, renumbered from 0."""
    first, last = int(order.offsets[experts.start]), int(order.offsets[experts.stop])
    offsets = order.offsets[experts.start:experts.stop + 1] - first
    return ExpertOrder(order.pair_order[first:last], offsets, order.top_k)


def expert_parallel_experts(hidden: torch.Tensor, weights: torch.Tensor, order: ExpertOrder,
                            gate_up_local: torch.Tensor, down_local: torch.Tensor,
                            experts: range, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Run this rank's experts on their rows, then all-gather every rank's output and sum."""
    partial = grouped_experts(hidden, weights, local_order(order, experts), gate_up_local,
                              down_local)
    gathered = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, partial, group=group)
    return torch.stack(gathered).sum(dim=0)
