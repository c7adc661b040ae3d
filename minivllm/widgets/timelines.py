"""The batching timeline: requests on the y axis, steps on the x axis, each cell what one did.

`timeline` reads a recording (a list of `StepTrace`) into plain data; `timeline_figure` draws it. A
cell is "prefill" or "decode" when the request was scheduled in that step (with its token count),
"waiting" when it sat in the waiting queue, "preempted" when the step took its blocks back ("swapped
out" when it took them to host memory instead), and "idle" when it was running but got no tokens
(the step's token budget was used up by others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.engine.trace import StepTrace
from minivllm.widgets.colors import KIND_COLORS, request_ids

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn, so `timeline` works without it
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

STATES = ("prefill", "decode", "waiting", "idle", "preempted", "swapped out")


@dataclass
class Timeline:
    request_ids: list[str]
    xs: list[int]  # the x of each recorded step: its step number, or the clock tick it ran at
    cells: dict[tuple[str, int], str] = field(default_factory=dict)  # (request, x) -> one of STATES
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)  # (request, x) -> tokens
    finished_at: dict[str, int] = field(default_factory=dict)  # request -> x it finished at
    arrivals: dict[str, int] = field(default_factory=dict)

    def row(self, request_id: str) -> list[str | None]:
        """The request's state at every x from 0 to the last x (None: not in the system)."""
        return [self.cells.get((request_id, x)) for x in range(self.last_x + 1)]

    @property
    def last_x(self) -> int:
        return max(self.xs, default=-1)

    def count(self, state: str, request_id: str | None = None) -> int:
        return sum(1 for (r, _), s in self.cells.items() if s == state and request_id in (None, r))


def timeline(steps: Sequence[StepTrace], clock: Sequence[int] | None = None,
             arrivals: dict[str, int] | None = None) -> Timeline:
    """Read a recording into a Timeline.

    `clock` gives the x of each step (e.g. the tick of a driver that can also idle); default: step
    numbers. `arrivals` (request -> x) marks a request "waiting" from its arrival until it is first
    scheduled, also where it waited outside the engine (a static batcher holding it back) and at
    ticks with no step at all.
    """
    steps = list(steps)
    xs = list(clock) if clock is not None else [t.step for t in steps]
    if len(xs) != len(steps):
        raise ValueError(f"clock has {len(xs)} entries for {len(steps)} steps")
    ids = request_ids(steps)
    if arrivals:
        ids = sorted(ids, key=lambda r: (arrivals.get(r, 0), ids.index(r)))
    tl = Timeline(ids, xs, arrivals=dict(arrivals or {}))
    for x, t in zip(xs, steps):
        scheduled = {e.request_id: e for e in t.scheduled}
        for rid, e in scheduled.items():
            tl.cells[rid, x] = e.kind
            tl.tokens[rid, x] = e.num_tokens
        for rid in t.preempted:
            tl.cells[rid, x] = "swapped out" if rid in t.swapped_out else "preempted"
        for rid in t.waiting:
            tl.cells.setdefault((rid, x), "waiting")
        for rid in t.running:
            tl.cells.setdefault((rid, x), "idle")
        for rid in t.finished:
            tl.finished_at[rid] = x
    for rid, arrived in tl.arrivals.items():
        first = min((x for (r, x), s in tl.cells.items()
                     if r == rid and s in ("prefill", "decode")), default=tl.last_x + 1)
        for x in range(arrived, first):
            tl.cells.setdefault((rid, x), "waiting")
    return tl


# steps per row of a wrapped timeline: 10 inches wide, legible in a 1400-pixel window
ROW_STEPS = 40
# prefill cells narrower than this (in points) get no token count: it would not fit
MIN_COUNT_CELL_PT = 14


def timeline_figure(tl: Timeline, title: str = "", ax: Axes | None = None,
                    xlabel: str = "engine step") -> Figure:
    """Draw the timeline: prefill cells carry their token count; a black bar marks a request's end.

    Without `ax`, a timeline longer than ROW_STEPS steps wraps onto rows (one axes per window of
    steps), so the figure stays at most 10 inches wide and its text readable at the size shown.
    """
    from matplotlib.figure import Figure

    start, end = min([0, *tl.arrivals.values()]), tl.last_x + 1
    if ax is not None:
        _draw_timeline(tl, ax, title, xlabel, (start, end))
        ax.figure.tight_layout()
        return ax.figure
    windows = [(a, min(a + ROW_STEPS, end)) for a in range(start, end, ROW_STEPS)] or [(start, end)]
    width = min(2 + 0.2 * (min(end - start, ROW_STEPS) + 2), 10)
    row_height = 0.9 + 0.34 * max(len(tl.request_ids), 1)
    fig = Figure(figsize=(width, row_height * len(windows)))
    axes = fig.subplots(len(windows), 1, squeeze=False)[:, 0]
    for i, (ax_i, window) in enumerate(zip(axes, windows)):
        _draw_timeline(tl, ax_i, title if i == 0 else "", xlabel if i == len(windows) - 1 else "",
                       window, legend=i == 0,
                       align_width=ROW_STEPS + 0.2 if len(windows) > 1 else None)
    fig.tight_layout()
    return fig


def _draw_timeline(tl: Timeline, ax: Axes, title: str, xlabel: str, window: tuple[int, int],
                   legend: bool = True, align_width: float | None = None) -> None:
    """Steps window[0] <= x < window[1] of the timeline on `ax` (every row keeps the same step width
    when `align_width` is given)."""
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    row_of = {rid: i for i, rid in enumerate(tl.request_ids)}
    lo, hi = window
    ax.set_xlim(lo, lo + align_width if align_width else hi + 0.2)
    fig = ax.figure
    cell_pt = ((ax.get_position().width * fig.get_figwidth() * 72)
               / max(ax.get_xlim()[1] - ax.get_xlim()[0], 1))
    for (rid, x), state in tl.cells.items():
        if not lo <= x < hi:
            continue
        y = row_of[rid]
        ax.add_patch(Rectangle((x, y), 0.95, 0.8, facecolor=KIND_COLORS[state], edgecolor="white",
                               linewidth=0.5))
        if state == "prefill" and cell_pt >= MIN_COUNT_CELL_PT:
            ax.text(x + 0.47, y + 0.4, str(tl.tokens[rid, x]), ha="center", va="center", fontsize=8,
                    color="white")
    for rid, x in tl.finished_at.items():
        if lo <= x < hi:
            ax.plot([x + 0.97, x + 0.97], [row_of[rid] - 0.05, row_of[rid] + 0.85], color="black",
                    linewidth=2)
    for rid, x in tl.arrivals.items():
        if lo <= x < hi:
            ax.plot([x], [row_of[rid] + 0.4], marker=">", color="black", markersize=4)
    ax.set_ylim(len(tl.request_ids), -0.2)
    ax.set_yticks([i + 0.4 for i in range(len(tl.request_ids))], tl.request_ids)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    if legend:
        handles = [Patch(facecolor=KIND_COLORS[s], label=s) for s in STATES
                   if s in tl.cells.values()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                  frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
