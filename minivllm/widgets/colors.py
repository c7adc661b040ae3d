"""One colour per request, stable across the steps of a recording; the colours the widgets share."""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.engine.trace import StepTrace

FREE_COLOR = "#ffffff"
SHARED_COLOR = "#bdbdbd"
KIND_COLORS = {"prefill": "#e4572e", "decode": "#4c9f70", "waiting": "#d9d9d9", "idle": "#f3e9b5",
               "preempted": "#7b2d8b", "swapped out": "#1f78b4"}
COPY_COLOR = "#e4572e"  # a block copied on write
NEW_COLOR = "#4c9f70"  # a block allocated in this step


def request_ids(steps: Iterable[StepTrace]) -> list[str]:
    """Every request named in a recording, in order of first appearance (within a step: the batch in
    schedule order, then the waiting queue)."""
    seen: dict[str, None] = {}
    for t in steps:
        for rid in [*(e.request_id for e in t.scheduled), *t.waiting, *t.block_tables, *t.finished,
                    *t.preempted, *t.running]:
            seen.setdefault(rid, None)
    return list(seen)


# matplotlib's tab20 then tab20b, every second colour first (the light halves of tab20: black text
# stays readable), written out so that the HTML views need no matplotlib; tests/test_widgets.py
# checks it against matplotlib's own colormaps.
PALETTE = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
           "#dbdb8d", "#9edae5", "#5254a3", "#9c9ede", "#8ca252", "#cedb9c", "#bd9e39", "#e7cb94",
           "#ad494a", "#e7969c", "#a55194", "#de9ed6", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
           "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#6b6ecf",
           "#637939", "#b5cf6b", "#8c6d31", "#e7ba52", "#843c39", "#d6616b", "#7b4173", "#ce6dbd")


def request_colors(ids: Iterable[str]) -> dict[str, str]:
    """A distinct pastel per request (tab20 then tab20b, cycling), in the order given."""
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(dict.fromkeys(ids))}
