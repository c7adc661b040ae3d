"""The block-table viewer: each request's logical blocks and the physical pool they map to.

Pure functions of one recorded `StepTrace` (no ipywidgets here): `pool_cells` turns the step into
plain data, `block_table_html` and `block_table_figure` draw it. The trace holds the block tables
*after* the step, so a request that finished in this step has already given its blocks back.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.core.math_utils import cdiv
from minivllm.engine.trace import StepTrace
from minivllm.widgets.colors import FREE_COLOR, SHARED_COLOR, request_colors
from minivllm.widgets.journey import QUIET_STYLE, where

# matplotlib is imported where a figure is drawn, so the HTML views work without it
if TYPE_CHECKING:
    from matplotlib.figure import Figure

_LABEL_BOX = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.9)
# a shared block's edge and hatching: grey, so that its label stays the darkest thing on it
_HATCH_EDGE = "0.35"


@dataclass
class BlockCell:
    """One physical block: who uses it (in table order) and how many tables point at it."""

    block_id: int
    owners: list[str]

    @property
    def ref_cnt(self) -> int:
        return len(self.owners)

    @property
    def is_free(self) -> bool:
        return not self.owners

    @property
    def is_shared(self) -> bool:
        return len(self.owners) > 1


def pool_cells(step: StepTrace) -> list[BlockCell]:
    """Every physical block of the pool with its owners, read from the step's block tables."""
    cells = [BlockCell(b, []) for b in range(step.num_total_blocks)]
    for rid, table in step.block_tables.items():
        for block_id in table:
            if block_id >= 0:  # -1: the window passed it, and it went back to the pool
                cells[block_id].owners.append(rid)
    for cell in cells:  # the engine's own ref counts must agree with what the tables say
        recorded = step.shared_blocks.get(cell.block_id)
        if recorded is not None and recorded != cell.ref_cnt:
            raise ValueError(f"block {cell.block_id}: trace says ref count {recorded}, tables say "
                             f"{cell.ref_cnt}")
    return cells


def blocks_to_show(step: StepTrace, max_blocks: int = 64, columns: int = 16) -> int:
    """How many pool cells to draw: all of a small pool, else every used block up to a full row."""
    if step.num_total_blocks <= max_blocks:
        return step.num_total_blocks
    top = max((b for table in step.block_tables.values() for b in table), default=-1) + 1
    return min(step.num_total_blocks, max(cdiv(max(top, columns), columns) * columns, max_blocks))


def block_table_html(step: StepTrace, block_size: int | None = None,
                     colors: dict[str, str] | None = None) -> str:
    """Each live request's block table as HTML: logical block index -> physical block id."""
    colors = colors or request_colors(step.block_tables)
    width = max((len(t) for t in step.block_tables.values()), default=0)
    head = "".join(f"<th>{i}</th>" for i in range(width))
    rows = []
    for rid, table in step.block_tables.items():
        td, cells = f'<td style="background:{colors[rid]};text-align:center">', []
        for block_id in table:
            shared = step.shared_blocks.get(block_id, 1)
            mark = f" <small>(x{shared} shared)</small>" if shared > 1 else ""
            cells.append(f"{td}{block_id}{mark}</td>" if block_id >= 0 else
                         '<td style="text-align:center" title="the window passed it">-</td>')
        rows.append(f"<tr><th>{html.escape(rid)}</th>{''.join(cells)}</tr>")
    if not rows:
        rows.append(f'<tr><td colspan="{width + 1}"><i>no live block tables</i></td></tr>')
    size = f", {block_size} tokens each" if block_size else ""
    caption = (f"engine step {step.step}: block tables (logical block -> physical block id{size}); "
               f"{step.num_free_blocks} of {step.num_total_blocks} blocks free")
    # the caption is a line of its own: a <caption> would wrap to the width of a narrow table
    return (f'<div class="minivllm-blocks minivllm-page"><div>{caption}</div><table>'
            f"<tr><th>request \\ logical</th>{head}</tr>{''.join(rows)}</table></div>")


def block_step_html(step: StepTrace, position: int | None = None, total: int | None = None,
                    block_size: int | None = None) -> str:
    """One line under the block-table viewer's controls: where we are and which blocks moved in this
    step (the figure shows the tables; most decode steps move none, which this line says)."""
    size = f" of {block_size} tokens" if block_size else ""
    n_shared = sum(1 for n in step.shared_blocks.values() if n > 1)
    kinds = (("allocated", step.allocated), ("re-used from the cache", step.cache_hits),
             ("freed", step.freed))
    moved = [f"{name} " + "; ".join(f"<b>{html.escape(r)}</b> {b}" for r, b in events.items())
             for name, events in kinds if events]
    change = (", ".join(moved) if moved
              else f'<span style="{QUIET_STYLE}">no block allocated or freed</span>')
    return (f'<div class="minivllm-blocks minivllm-page"><b>{where(step.step, position, total)}'
            f"</b>: {step.num_free_blocks} of {step.num_total_blocks} blocks{size} free, "
            f"{n_shared} shared; {change}</div>")


def _block_patch(x: float, y: float, face: str, shared: bool, **style):
    """One block's square; a shared one is hatched with a grey edge, so its label stays readable."""
    from matplotlib.patches import Rectangle

    style = style or dict(edgecolor=_HATCH_EDGE if shared else "black",
                          hatch="//" if shared else None)
    return Rectangle((x, y), 0.92, 0.85, facecolor=face, linewidth=0.6, **style)


def _draw_tables(ax, step: StepTrace, cells: list[BlockCell], colors: dict[str, str],
                 xmax: int, title: str) -> None:
    """The block tables: row = request, column = logical block index, text = physical block id."""
    tables = step.block_tables
    width = max([len(t) for t in tables.values()] + [1])
    for row, (rid, table) in enumerate(tables.items()):
        for i, block_id in enumerate(table):
            if block_id < 0:  # the window passed it: back in the pool
                ax.add_patch(_block_patch(i, row, FREE_COLOR, False, edgecolor="0.6",
                                          linestyle="--"))
                continue
            shared = cells[block_id].is_shared
            ax.add_patch(_block_patch(i, row, colors[rid], shared))
            ax.text(i + 0.46, row + 0.42, str(block_id), ha="center", va="center",
                    fontsize=8 if shared else 7,
                    fontweight="bold" if shared else None, bbox=_LABEL_BOX if shared else None)
    ax.set(xlim=(0, xmax), ylim=(max(len(tables), 1), 0))
    ax.set_yticks([r + 0.42 for r in range(len(tables))], list(tables))
    ax.set_xticks([i + 0.46 for i in range(width)], [str(i) for i in range(width)], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_title(f"{title}: block tables (column = logical block, number = physical block id)",
                 fontsize=9, pad=14)
    if not tables:
        ax.text(0.5, 0.5, "no live requests", ha="center", va="center", transform=ax.transAxes)
    ax.spines[["bottom", "right"]].set_visible(False)


def _draw_pool(ax, step: StepTrace, cells: list[BlockCell], shown: int, colors: dict[str, str],
               columns: int, xmax: int) -> None:
    """The physical pool as a grid: the first `shown` blocks, and a count of those not drawn."""
    for cell in cells[:shown]:
        r, c = divmod(cell.block_id, columns)
        if cell.is_free:
            ax.add_patch(_block_patch(c, r, FREE_COLOR, False, edgecolor="0.6", linestyle="--"))
        else:
            face = SHARED_COLOR if cell.is_shared else colors[cell.owners[0]]
            ax.add_patch(_block_patch(c, r, face, cell.is_shared))
        # id and reference count on two lines, large enough to read over the hatching
        if cell.is_shared:
            ax.text(c + 0.46, r + 0.42, f"{cell.block_id}\nx{cell.ref_cnt}", ha="center",
                    va="center", fontsize=7, fontweight="bold", linespacing=0.9, bbox=_LABEL_BOX)
        else:
            ax.text(c + 0.46, r + 0.42, str(cell.block_id), ha="center", va="center", fontsize=6)
    ax.set(xlim=(0, xmax), ylim=(cdiv(shown, columns), 0), xticks=[], yticks=[])
    hidden = cells[shown:]
    hidden_used = sum(not c.is_free for c in hidden)
    more = f" (+{len(hidden)} more not drawn, {hidden_used} of them in use)" if hidden else ""
    n_shared = sum(c.is_shared for c in cells)
    ax.set_title(f"physical block pool: {step.num_free_blocks} of {step.num_total_blocks} free, "
                 f"{n_shared} shared{more}", fontsize=9)


def block_table_figure(step: StepTrace, max_blocks: int = 64, columns: int = 16,
                       colors: dict[str, str] | None = None, label: str | None = None) -> Figure:
    """Top: each request's block table. Bottom: the physical pool as a grid, one colour per request.

    Free blocks are white with a dashed edge; a block in several tables (a shared prefix-cache
    block) is hatched (grey in the pool) and labelled with its reference count. `label` starts the
    title (default: the engine's step number; the widgets pass their "step k of N").
    """
    from matplotlib.figure import Figure

    cells = pool_cells(step)
    shown = blocks_to_show(step, max_blocks, columns)
    colors = colors or request_colors(step.block_tables)
    xmax = max(max([len(t) for t in step.block_tables.values()] + [1]), columns)
    pool_rows = cdiv(shown, columns)
    top_h = max(len(step.block_tables), 1)
    fig = Figure(figsize=(0.45 * xmax + 1.6, 0.45 * (top_h + pool_rows) + 1.6))
    gs = fig.add_gridspec(2, 1, height_ratios=[top_h, pool_rows], hspace=0.35)
    ax_t, ax_p = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
    _draw_tables(ax_t, step, cells, colors, xmax, label or where(step.step, None, None))
    _draw_pool(ax_p, step, cells, shown, colors, columns, xmax)
    return fig
