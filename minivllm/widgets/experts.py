"""Mixture-of-experts views of a recording: which experts the router chose, how evenly they were
loaded, what a step had to read, and what splitting the experts over ranks sends between them.

Everything here is a pure function of plain data the engine recorded: `loads[step][layer][expert]`
(tokens routed to each expert, the trace's per-step expert load) and, for the per-token view,
`choices[layer][token]` (the k expert ids the router picked) with their weights. The traffic
functions take only the model's shapes. No figure here computes a routing of its own.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.widgets.colors import PALETTE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Load = Sequence[Sequence[int]]  # [layer][expert] tokens routed, one step


def expert_color(expert: int) -> str:
    """A stable colour per expert id (the widgets' shared palette)."""
    return PALETTE[expert % len(PALETTE)]


def imbalance(tokens_per_expert: Sequence[int]) -> float:
    """The busiest expert's tokens over the mean per expert: 1.0 is a perfectly even load.

    The step waits for its busiest expert (on a GPU, its block of rows is the longest; across
    expert-parallel ranks, its rank finishes last), so this ratio is the step's slowdown over an
    even split. With E experts and k per token the worst case is E / k (one expert in every pair).
    0.0 for a layer that saw no tokens."""
    total = sum(tokens_per_expert)
    return max(tokens_per_expert) * len(tokens_per_expert) / total if total else 0.0


def experts_touched(load: Load) -> list[int]:
    """Per layer, how many distinct experts received at least one token in the step."""
    return [sum(1 for n in layer if n) for layer in load]


def expert_bytes_read(load: Load, bytes_per_expert: int) -> int:
    """Expert weight bytes one step had to read: every touched expert's gate, up and down, once.

    An expert with no token is never read (model/moe.py skips empty blocks); one with many tokens
    is read once for all of them, which is where batching pays."""
    return sum(experts_touched(load)) * bytes_per_expert


def expert_load_figure(loads: Sequence[Load], title: str = "") -> Figure:
    """Per layer, a heat map of tokens per expert (rows) per step (columns), coloured by each
    expert's share of the step's rows (white: none, darkest: half or more), and under it each
    step's imbalance (busiest expert / mean). Counts are written in the cells when they fit."""
    from matplotlib.figure import Figure

    if not loads:
        raise ValueError("no steps with an expert load: run the engine with trace_steps and a "
                         "mixture-of-experts model")
    num_layers, num_experts = len(loads[0]), len(loads[0][0])
    fig = Figure(figsize=(min(13, 2.5 + 0.45 * len(loads)) * 1.0, 1.2 + 2.6 * num_layers),
                 layout="constrained")
    axes = fig.subplots(2 * num_layers, 1, sharex=True,
                        gridspec_kw={"height_ratios": [num_experts, 3] * num_layers})
    for layer in range(num_layers):
        heat, line = axes[2 * layer], axes[2 * layer + 1]
        grid = [[step[layer][e] for step in loads] for e in range(num_experts)]
        # coloured by the share of the step's rows, so a prefill and a decode step compare
        shares = [[n / (sum(step[layer]) or 1) for n, step in zip(row, loads)] for row in grid]
        heat.imshow(shares, aspect="auto", cmap="Blues", vmin=0, vmax=0.5, interpolation="nearest")
        if len(loads) <= 40:
            for e in range(num_experts):
                for s, n in enumerate(grid[e]):
                    heat.text(s, e, str(n), ha="center", va="center", fontsize=7,
                              color="white" if shares[e][s] > 0.3 else "black")
        heat.set_yticks(range(num_experts), [f"expert {e}" for e in range(num_experts)],
                        fontsize=7)
        heat.set_title(f"layer {layer}: tokens routed to each expert (colour: share of the step)",
                       fontsize=9, loc="left")
        ratios = [imbalance(step[layer]) for step in loads]
        line.plot(range(len(loads)), ratios, marker="o", ms=3, color="#e4572e")
        line.axhline(1.0, color="#888", lw=0.8, ls="--")
        line.set_ylim(0, max(2.0, 1.1 * max(ratios)))
        line.set_ylabel("busiest /\nmean", fontsize=7)
        line.tick_params(labelsize=7)
    axes[-1].set_xlabel("engine step")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def router_choices_html(tokens: Sequence[str], choices: Sequence[Sequence[Sequence[int]]],
                        weights: Sequence[Sequence[Sequence[float]]] | None = None) -> str:
    """One row per token, one column per layer: the experts the router chose for it (coloured by
    expert), each with its weight in the sum when given. `choices[layer][token]` lists k ids."""
    head = "".join(f"<th style='padding:2px 8px'>layer {i}</th>" for i in range(len(choices)))
    rows = []
    for t, token in enumerate(tokens):
        cells = []
        for layer, picked in enumerate(choices):
            chips = []
            for slot, expert in enumerate(picked[t]):
                w = f" <small>{weights[layer][t][slot]:.2f}</small>" if weights is not None else ""
                chips.append(f"<span style='background:{expert_color(expert)};border:1px solid "
                             f"#888;padding:0 5px;margin-right:2px'>{expert}{w}</span>")
            cells.append(f"<td style='padding:1px 8px'>{''.join(chips)}</td>")
        rows.append(f"<tr><td style='font-family:monospace;text-align:right;padding-right:8px'>"
                     f"{html.escape(repr(token))}</td>{''.join(cells)}</tr>")
    return (f"<table style='border-collapse:collapse;font-size:12px'><tr><th>token</th>{head}</tr>"
            f"{''.join(rows)}</table>")


@dataclass(frozen=True)
class MoeTraffic:
    """What one MoE layer's step sends between ranks under one way of splitting the experts."""

    scheme: str
    collective: str
    tensor_bytes: int  # the tensor each rank hands to the collective
    wire_bytes: int  # what each rank sends for it (ring all-reduce / all-gather, even all-to-all)


def moe_traffic(tokens: int, hidden_size: int, top_k: int, ranks: int,
                itemsize: int) -> list[MoeTraffic]:
    """Bytes per rank, per MoE layer, per step, computed from the shapes alone.

    * Tensor parallel (vLLM's default): every rank holds a slice of every expert and every token;
      its output is a partial sum of every token's row: one all-reduce of [tokens, hidden].
    * Expert parallel as minivllm runs it: whole experts per rank, attention still tensor
      parallel, so every rank already holds every token; each rank's output is the sum over its
      own experts: the same one all-reduce (an all-gather and a sum in one collective).
    * Expert parallel with data-parallel attention (DeepSeek-style deployments): each rank owns
      tokens/ranks of the batch and sends each of its token's k rows to the rank of that expert
      (all-to-all dispatch), then gets the outputs back (combine). With experts spread evenly a
      row stays home 1/ranks of the time.
    A ring all-reduce sends 2 (N - 1) / N of its tensor from every rank, an all-to-all (N - 1) / N
    of what a rank dispatches."""
    rows = tokens * hidden_size * itemsize
    ring = rows * 2 * (ranks - 1) // ranks
    dispatched = tokens * top_k * hidden_size * itemsize // ranks  # this rank's tokens' k rows
    away = dispatched * (ranks - 1) // ranks
    reduce = "all-reduce [tokens, hidden]"
    return [MoeTraffic("tensor parallel (expert slices)", reduce, rows, ring),
            MoeTraffic("expert parallel, minivllm", reduce, rows, ring),
            MoeTraffic("expert parallel + data-parallel attention", "all-to-all dispatch + combine",
                       2 * dispatched, 2 * away)]


def traffic_html(rows_by_case: dict[str, list[MoeTraffic]]) -> str:
    """A table of `moe_traffic` results, one block of rows per case (e.g. "batch 64, 8 ranks")."""
    body = []
    for case, rows in rows_by_case.items():
        for i, r in enumerate(rows):
            label = f"<b>{html.escape(case)}</b>" if i == 0 else ""
            body.append(f"<tr><td>{label}</td><td>{html.escape(r.scheme)}</td>"
                        f"<td>{html.escape(r.collective)}</td>"
                        f"<td style='text-align:right'>{r.tensor_bytes:,}</td>"
                        f"<td style='text-align:right'>{r.wire_bytes:,}</td></tr>")
    return ("<table style='font-size:12px'><tr><th>case</th><th>split</th><th>collective</th>"
            "<th>bytes handed in per rank</th><th>bytes sent per rank</th></tr>"
            + "".join(body) + "</table>")
