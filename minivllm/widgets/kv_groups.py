"""A hybrid model's block tables, one row per group of layers (core/kv_groups.py).

Pure functions of one recorded `StepTrace`: a request's table holds every group's blocks,
interleaved; `group_tables` splits it, and `group_tables_figure` draws a row per group, a column
per logical block, with the blocks a sliding window has passed (given back to the pool) left empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.engine.trace import StepTrace
from minivllm.widgets.colors import FREE_COLOR

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def group_tables(step: StepTrace, request_id: str) -> list[list[int]]:
    """Row g: group g's physical block per logical block of the request (-1: given back)."""
    table, n = step.block_tables[request_id], step.num_kv_groups
    return [table[g::n] for g in range(n)]


def group_tables_figure(step: StepTrace, request_id: str, group_names: list[str],
                        color: str = "#4c72b0") -> Figure:
    """A row per group of layers (named by `group_names`), a square per logical block: filled
    while the group holds it, empty once the window has passed it and it went back."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    rows = group_tables(step, request_id)
    width = max(len(r) for r in rows)
    fig = Figure(figsize=(min(0.16 * width + 2.5, 14), 0.32 * len(rows) + 1.5))
    ax = fig.add_subplot()
    for g, row in enumerate(rows):
        for j, block in enumerate(row):
            held = block >= 0
            ax.add_patch(Rectangle((j, g), 0.9, 0.8, facecolor=color if held else FREE_COLOR,
                                   edgecolor="none" if held else "0.7", linewidth=0.5))
    held = sum(b >= 0 for row in rows for b in row)
    ax.set(xlim=(0, width), ylim=(len(rows), 0), xlabel="logical block")
    ax.set_yticks([g + 0.4 for g in range(len(rows))], group_names, fontsize=8)
    ax.set_title(f"{request_id} after step {step.step}: {held} of {sum(map(len, rows))} blocks "
                 f"held, one table per group of layers (empty: the window passed it)", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    return fig
