"""Memory-pressure views of a recording: block tables forking under beam search; what was swapped.

`fork_rows` reads the steps into plain data (per step, per live sequence: each block and whether it
is shared, copied on write or new); `fork_html` draws it as an HTML table. `swap_totals` adds up
what a recording swapped. Pure functions of `StepTrace`s, like the other widgets.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from minivllm.engine.trace import StepTrace
from minivllm.widgets.colors import COPY_COLOR, FREE_COLOR, NEW_COLOR, SHARED_COLOR


@dataclass
class ForkRow:
    step: int
    request_id: str
    blocks: list[tuple[int, str]]  # (block id, "shared" | "copied" | "new" | "own")
    forked: bool  # the sequence was forked from a parent in this step


def fork_rows(steps: Sequence[StepTrace]) -> list[ForkRow]:
    """Every live sequence's table at every step, each block classified as the step left it."""
    rows = []
    for t in steps:
        for rid, table in t.block_tables.items():
            copied, new = set(t.copied.get(rid, ())), set(t.allocated.get(rid, ()))
            kinds = [(b, "copied" if b in copied else "shared" if b in t.shared_blocks else
                      "new" if b in new else "own") for b in table]
            rows.append(ForkRow(t.step, rid, kinds, rid in t.forked))
    return rows


def fork_html(steps: Sequence[StepTrace]) -> str:
    """One line per live sequence per step: its blocks, shared ones grey (with their ref count),
    copies made on write red, fresh ones green: the tables fork, share a prefix, split on writes."""
    colors = {"shared": SHARED_COLOR, "copied": COPY_COLOR, "new": NEW_COLOR, "own": FREE_COLOR}
    refs = {t.step: t.shared_blocks for t in steps}
    lines, last = [], None
    for row in fork_rows(steps):
        step = f"<b>step {row.step}</b>" if row.step != last else ""
        last = row.step
        cells = "".join(f'<td style="background:{colors[kind]};border:1px solid #888;padding:1px '
                        f'4px;font-size:11px">{b}'
                        + (f"<sub>×{refs[row.step][b]}</sub>" if kind == "shared" else "") + "</td>"
                        for b, kind in row.blocks)
        mark = " (forked)" if row.forked else ""
        lines.append(f"<tr><td>{step}</td><td style='font-family:monospace'>"
                     f"{html.escape(row.request_id)}{mark}</td><td><table "
                     f"style='border-collapse:collapse'><tr>{cells}</tr></table></td></tr>")
    legend = " ".join(f'<span style="background:{c};border:1px solid #888;padding:0 6px">{k}</span>'
                      for k, c in colors.items())
    return f"<div>{legend}</div><table>{''.join(lines)}</table>"


def swap_totals(steps: Sequence[StepTrace]) -> dict[str, int]:
    """Blocks swapped out and in, and the bytes moved, over a recording."""
    return {"blocks_out": sum(len(b) for t in steps for b in t.swapped_out.values()),
            "blocks_in": sum(len(b) for t in steps for b in t.swapped_in.values()),
            "bytes": sum(t.num_swap_bytes for t in steps)}
