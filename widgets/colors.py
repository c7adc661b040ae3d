"""One colour per request, stable across the steps of a recording, and the other colours the widgets share."""

from __future__ import annotations

from collections.abc import Iterable

from matplotlib import colormaps
from matplotlib.colors import to_hex

from minivllm.engine.trace import StepTrace

FREE_COLOR = "#ffffff"
SHARED_COLOR = "#bdbdbd"
KIND_COLORS = {"prefill": "#e4572e", "decode": "#4c9f70", "waiting": "#d9d9d9", "idle": "#f3e9b5",
               "preempted": "#7b2d8b"}


def request_ids(steps: Iterable[StepTrace]) -> list[str]:
    """Every request named in a recording, in order of first appearance (within a step: the batch in
    schedule order, then the waiting queue)."""
    seen: dict[str, None] = {}
    for t in steps:
        for rid in [*(e.request_id for e in t.scheduled), *t.waiting, *t.block_tables, *t.finished,
                    *t.preempted, *t.running]:
            seen.setdefault(rid, None)
    return list(seen)


def request_colors(ids: Iterable[str]) -> dict[str, str]:
    """A distinct pastel per request (tab20 then tab20b, cycling), in the order given."""
    palette = [to_hex(c) for name in ("tab20", "tab20b") for c in colormaps[name].colors]
    palette = palette[1::2] + palette[0::2]  # the light halves first: black text stays readable
    return {rid: palette[i % len(palette)] for i, rid in enumerate(dict.fromkeys(ids))}
