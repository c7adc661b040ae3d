"""A plain-text view of the step trace: one line per engine step (for the CLI and `make demo`)."""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.engine.trace import StepTrace


def format_step(t: StepTrace) -> str:
    work = ", ".join(f"{e.request_id}:{e.kind}x{e.num_tokens}" for e in t.scheduled)
    parts = [f"step {t.step:3d}", f"[{work}]"]
    if t.allocated:
        parts.append("alloc " + " ".join(f"{r}{b}" for r, b in t.allocated.items()))
    if t.cache_hits:
        parts.append("cached " + " ".join(f"{r}{b}" for r, b in t.cache_hits.items()))
    if t.preempted:
        parts.append(f"preempted {t.preempted}")
    if t.finished:
        parts.append("finished " + " ".join(f"{r}({why})" for r, why in t.finished.items()))
    if t.freed:
        parts.append("freed " + " ".join(f"{r}{b}" for r, b in t.freed.items()))
    parts.append(f"free {t.num_free_blocks}/{t.num_total_blocks}")
    return "  ".join(parts)


def format_journey(trace: Iterable[StepTrace], max_lines: int = 40) -> str:
    """Every step that changed something interesting; plain decode steps between them counted."""
    lines, quiet = [], 0
    for t in trace:
        interesting = (t.allocated or t.freed or t.preempted or t.finished or t.num_prefill_tokens
                       or t.cache_hits)
        if interesting or not lines:
            if quiet:
                lines.append(f"  ... {quiet} decode step(s) ...")
                quiet = 0
            lines.append(format_step(t))
        else:
            quiet += 1
    if quiet:
        lines.append(f"  ... {quiet} decode step(s) ...")
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"  ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)
