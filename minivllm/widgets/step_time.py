"""Where a step's time goes, as measured: the host's work around the model against its forward pass.

`step_time_breakdown` takes the median of the engine's own per-step timings
(StepRecord.phase_seconds, and the runner's forward_seconds) over the steps it is given;
`step_time_figure` draws one stacked bar per batch size.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from minivllm.engine.trace import StepRecord

# the parts of a step, in the order they run; all but "model forward" are Python on the host
PARTS = ("schedule", "prepare inputs + sample", "model forward", "update + output")
COLORS = ("#9ecae1", "#6baed6", "#fd8d3c", "#3182bd")


def step_time_breakdown(records: Sequence[StepRecord]) -> dict[str, float]:
    """Median milliseconds per step of each part in PARTS over `records` (steps that ran the model).

    The median, not the mean: on a shared machine a few steps are slowed by other processes.
    """
    if not records:
        raise ValueError("no steps to measure: run the engine with a step observer that keeps its "
                         "records")
    samples: dict[str, list[float]] = {part: [] for part in PARTS}
    for r in records:
        phases, forward = r.phase_seconds, r.runner_output.forward_seconds
        samples["schedule"].append(phases.get("schedule", 0.0))
        samples["prepare inputs + sample"].append(max(0.0, phases.get("run", 0.0) - forward))
        samples["model forward"].append(forward)
        samples["update + output"].append(phases.get("update", 0.0) + phases.get("output", 0.0))
    return {part: 1e3 * statistics.median(values) for part, values in samples.items()}


def host_share(breakdown: dict[str, float]) -> float:
    """The fraction of the step spent outside the model's forward pass."""
    total = sum(breakdown.values())
    return (total - breakdown["model forward"]) / total if total else 0.0


def step_time_figure(breakdowns: dict[str, dict[str, float]], title: str = "") -> Figure:
    """One horizontal stacked bar per label (e.g. "batch 1"): milliseconds per step by part."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 1.3 + 0.5 * len(breakdowns)), layout="constrained")
    ax = fig.add_subplot()
    labels = list(breakdowns)
    for y, label in enumerate(labels):
        left = 0.0
        for part, color in zip(PARTS, COLORS):
            width = breakdowns[label][part]
            ax.barh(y, width, left=left, color=color, label=part if y == 0 else None)
            left += width
        ax.text(left, y, f"  {left:.1f} ms, host {host_share(breakdowns[label]):.0%}", va="center",
                fontsize=9)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step (median over the steps measured)")
    ax.set_xlim(0, 1.3 * max(sum(b.values()) for b in breakdowns.values()))
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
