"""The journey stepper's page: what one recorded engine step did, as HTML (pure; no ipywidgets)."""

from __future__ import annotations

import html

from minivllm.engine.trace import StepTrace
from minivllm.widgets.colors import KIND_COLORS, request_colors

# The same look inside a widget and in a plain HTML output: JupyterLab's rendered-HTML styles
# (right-aligned, striped, padded cells) reach only the latter, and a <style> element does not
# survive every front end, so the tables carry their style inline.
_CELL = "text-align:left;vertical-align:top;padding:1px 8px;border:none"
QUIET_STYLE = "color:#666;font-style:italic"


def inline_styles(page: str) -> str:
    """Give a page's tables, rows, cells and headings inline styles (a cell keeps its own)."""
    return (page.replace('<td style="', f'<td style="{_CELL};')
            .replace("<td>", f'<td style="{_CELL}">')
            .replace("<th>", f'<th style="{_CELL};font-weight:bold">')
            .replace("<tr>", '<tr style="background:none">')
            .replace("<table",
                     '<table style="border-collapse:collapse;margin:2px 0;font-size:13px"')
            .replace("<h4>",
                     '<h4 style="margin:2px 0 4px;padding:0;font-size:14px;font-weight:bold">'))


def _ids(ids) -> str:
    return ", ".join(html.escape(str(i)) for i in ids) if ids else "<i>none</i>"


def _by_request(events: dict[str, list[int]]) -> str:
    return "; ".join(f"<b>{html.escape(rid)}</b> {blocks}" for rid, blocks in events.items())


def _token_text(tokenizer, token: int | None) -> str:
    if token is None:
        return "<i>none yet (prefill chunk)</i>"
    if tokenizer is None:
        return str(token)
    return f"{token} <code>{html.escape(repr(tokenizer.decode([token])))}</code>"


def where(engine_step: int, position: int | None, total: int | None, noun: str = "step") -> str:
    """`step 3 of 32 (engine step 40)`: the position counts from 1, as the widgets' sliders do; the
    engine's own step number, which counts from 0 since the engine started, is named as such."""
    if position is not None and total:
        return f"{noun} {position + 1} of {total} (engine step {engine_step})"
    return f"engine step {engine_step}"


def step_html(step: StepTrace, position: int | None = None, total: int | None = None,
              tokenizer=None, colors: dict[str, str] | None = None) -> str:
    """The waiting queue, the batch, tokens per request, blocks in and out, preemptions, finishes.

    `tokenizer` (anything with `decode(list[int]) -> str`, e.g. `llm.tokenizer`) adds each sampled
    token's text; `position`/`total` place the step in the recording. Events that did not happen
    share one line at the end, so the page stays short enough to sit above its figure.
    """
    colors = colors or request_colors([e.request_id for e in step.scheduled] + step.waiting)
    kinds = [f"{kind} {n} token{'s' * (n != 1)}" for kind, n in
             (("prefill", step.num_prefill_tokens), ("decode", step.num_decode_tokens)) if n]
    head = (f"<h4>{where(step.step, position, total)}: {', '.join(kinds) or 'nothing scheduled'}; "
            f"{step.num_free_blocks} of {step.num_total_blocks} KV blocks free</h4>")
    rows = []
    for e in step.scheduled:
        color = colors.get(e.request_id, "#ffffff")
        rows.append(
            f'<tr><td style="background:{color}"><b>{html.escape(e.request_id)}</b></td>'
            f'<td style="color:{KIND_COLORS[e.kind]}"><b>{e.kind}</b></td><td>{e.num_tokens}</td>'
            f"<td>{e.num_computed_before} &rarr; {e.num_computed_before + e.num_tokens}</td>"
            f"<td>{_token_text(tokenizer, e.sampled_token)}</td></tr>")
    batch = ('<table class="minivllm-step"><tr><th>request</th><th>kind</th><th>tokens this step'
             "</th><th>tokens in KV cache</th><th>sampled token</th></tr>" + "".join(rows)
             + "</table>")
    finished = "; ".join(f"<b>{html.escape(r)}</b> ({why})" for r, why in step.finished.items())
    facts = [("scheduled (the batch)", batch if rows else "<i>none</i>"),
             ("waiting queue after the step (FCFS order)", _ids(step.waiting)),
             ("running after the step", _ids(step.running))]
    events = [("blocks allocated", _by_request(step.allocated)),
              ("blocks re-used from the prefix cache", _by_request(step.cache_hits)),
              ("blocks freed", _by_request(step.freed)),
              ("preempted", step.preempted and _ids(step.preempted)), ("finished", finished)]
    facts += [(name, value) for name, value in events if value]
    quiet = [name for name, value in events if not value]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    none = (f'<div style="{QUIET_STYLE}">none in this step: {", ".join(quiet)}</div>' if quiet
            else "")
    return inline_styles(f'<div class="minivllm-journey minivllm-page">{head}<table>{body}</table>'
                         f"{none}</div>")


def empty_html(message: str = "no steps recorded yet: press Step") -> str:
    return f'<div class="minivllm-journey minivllm-page"><i>{html.escape(message)}</i></div>'
