"""The speculation stepper's page: one verification round of speculative decoding, token by token.

Pure functions of a recorded trace (no ipywidgets here): `spec_rounds` reads, for each step that
gave one request tokens, what the drafter proposed, how many drafts the target accepted and the
tokens appended; `speculation_html` draws one such round.

Every appended token is one *reveal*: reveal i is draft i accepted, or the first rejected draft
replaced by the target's correction, or (after k accepted drafts) the target's bonus token. Stepping
through the reveals walks the output exactly one token at a time, in the order the target vouched
for them.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from minivllm.engine.trace import StepTrace
from minivllm.widgets.journey import where

ACCEPTED_COLOR = "#b7e4c7"
REJECTED_COLOR = "#f4a3a3"
TARGET_COLOR = "#a9cce3"
DISCARDED_COLOR = "#eeeeee"
PENDING_COLOR = "#ffffff"


@dataclass
class SpecRound:
    """One step in which a request got tokens: its drafts, the verdict, and what was appended."""

    step: int
    request_id: str
    kind: str  # "prefill" (the first token comes from the prompt's last position) or "decode"
    output_before: list[int]  # the request's output tokens before this step
    drafted: list[int]  # the drafter's proposals verified in this step (empty: a plain step)
    num_accepted: int
    new_token_ids: list[int]  # accepted drafts + the target's token (fewer if it stopped early)

    @property
    def rejected_index(self) -> int | None:
        """Position of the first draft the target disagreed with; None if none was rejected."""
        return self.num_accepted if self.num_accepted < len(self.drafted) else None

    @property
    def target_token(self) -> int | None:
        """The target's own token: the first rejected draft's correction, or the bonus after all."""
        if len(self.new_token_ids) > self.num_accepted:
            return self.new_token_ids[self.num_accepted]
        return None  # the request stopped (EOS, stop token) on an accepted draft

    @property
    def outcome(self) -> str:
        if not self.drafted:
            return "plain"
        return "bonus" if self.rejected_index is None else "correction"

    @property
    def num_reveals(self) -> int:
        """One reveal per appended token."""
        return len(self.new_token_ids)


def spec_rounds(steps: Sequence[StepTrace], request_id: str) -> list[SpecRound]:
    """Every step of `steps` that appended tokens to `request_id`, with its drafts and verdict."""
    rounds, output = [], []
    for t in steps:
        for e in t.scheduled:
            if e.request_id != request_id or not e.new_token_ids:
                continue
            rounds.append(SpecRound(t.step, request_id, e.kind, list(output),
                                    list(e.spec_token_ids), e.num_accepted, list(e.new_token_ids)))
            output += e.new_token_ids
    return rounds


def _text(tokenizer, ids: Sequence[int]) -> str:
    """A token's text made visible: spaces as a middle dot, newlines as a return arrow."""
    if tokenizer is None:
        return " ".join(str(i) for i in ids)
    return tokenizer.decode(list(ids)).replace(" ", "\u00b7").replace("\n", "\u21b5")


def _cell(token_text: str, verdict: str, color: str, strike: bool = False) -> str:
    body = f"<s>{html.escape(token_text)}</s>" if strike else html.escape(token_text)
    return (f'<td style="background:{color};text-align:center;padding:2px 6px;border:1px solid '
            f'#999"><code>{body}</code><br><small>{verdict}</small></td>')


def _context_line(rnd: SpecRound, tokenizer, shown: int, prompt_token_ids: Sequence[int],
                  context_chars: int) -> str:
    """The text before this round, then the tokens revealed so far highlighted, to read in place."""
    before = [*prompt_token_ids, *rnd.output_before]
    # decode whole sequences, so word boundaries come out as the tokenizer means them
    if tokenizer is not None:
        context = tokenizer.decode(before)
        so_far = tokenizer.decode(before + rnd.new_token_ids[:shown])[len(context):]
    else:
        context, so_far = _text(None, before), _text(None, rnd.new_token_ids[:shown])
    if len(context) > context_chars:
        context = "\u2026" + context[-context_chars:]
    return (f'<div>context: <code>{html.escape(context)}</code><span style="background:'
            f'{ACCEPTED_COLOR}"><code>{html.escape(so_far)}</code></span></div>')


def _draft_cell(rnd: SpecRound, tokenizer, shown: int, i: int, d: int) -> str:
    """Draft i's cell, marked with its verdict once the reveals have reached it."""
    text = _text(tokenizer, [d])
    rejected = rnd.rejected_index
    # a draft is judged once the token at its position is revealed; those after a rejection with it
    judged_at = rejected if rejected is not None and i > rejected else i
    if not (shown == rnd.num_reveals or shown > judged_at):
        return _cell(text, "pending", PENDING_COLOR)
    if rnd.target_token is None and i >= rnd.num_reveals:  # the request stopped (EOS, a stop token)
        return _cell(text, "after the stop", DISCARDED_COLOR, strike=True)
    if i < rnd.num_accepted:
        return _cell(text, "accepted", ACCEPTED_COLOR)
    if i == rejected:
        fix = rnd.target_token
        fix_text = _text(tokenizer, [fix]) if fix is not None else "?"
        return _cell(text, f"rejected \u2192 <code>{html.escape(fix_text)}</code>",
                     REJECTED_COLOR, strike=True)
    return _cell(text, "discarded", DISCARDED_COLOR, strike=True)


def _target_cells(rnd: SpecRound, tokenizer, shown: int) -> list[str]:
    """The target's own token after the drafts: the bonus, or a plain step's only token."""
    if rnd.outcome == "plain":
        ids, seen, verdict = rnd.new_token_ids, shown > 0, "target"
    elif rnd.outcome == "bonus" and rnd.target_token is not None:
        ids, seen, verdict = [rnd.target_token], shown > len(rnd.drafted), "bonus (target)"
    else:
        return []
    return [_cell(_text(tokenizer, ids) if seen else "?", verdict if seen else "pending",
                  TARGET_COLOR if seen else PENDING_COLOR)]


def _summary_line(rnd: SpecRound, shown: int) -> str:
    """The round's verdict in words once fully revealed, else how far the reveals have got."""
    if shown < rnd.num_reveals:
        return f"<div>revealed {shown} of {rnd.num_reveals} appended tokens: press Step</div>"
    if rnd.outcome == "correction":
        i = rnd.rejected_index
        return (f"<div>disagreement at draft {i + 1}: the first {i} kept, draft {i + 1} corrected "
                f"by the target, {len(rnd.drafted) - i - 1} discarded after it</div>")
    if rnd.outcome == "bonus":
        return (f"<div>all {len(rnd.drafted)} drafts accepted, plus the target's bonus "
                f"token: {len(rnd.new_token_ids)} tokens from one target pass</div>")
    return ""


def speculation_html(rnd: SpecRound, tokenizer=None, revealed: int | None = None,
                     position: int | None = None, total: int | None = None,
                     prompt_token_ids: Sequence[int] = (), context_chars: int = 80) -> str:
    """One round as HTML; `revealed`: how many appended tokens to show judged so far (None: all).

    The context line is the prompt (`prompt_token_ids`, if given) and the output before this round,
    then the tokens revealed so far, highlighted. Below, one cell per draft (then the target's bonus
    token): accepted, rejected -> the target's correction, discarded (after a rejection) or pending.
    """
    shown = rnd.num_reveals if revealed is None else max(0, min(revealed, rnd.num_reveals))
    if rnd.outcome == "plain":
        what = ("no drafts: the target's own token" if rnd.kind == "decode"
                else "prefill: the first token")
    else:
        what = (f"{len(rnd.drafted)} drafted, {rnd.num_accepted} accepted, "
                f"{len(rnd.new_token_ids)} appended")
    head = (f"<h4>{where(rnd.step, position, total, 'round')}: request "
            f"<b>{html.escape(rnd.request_id)}</b>, {what}</h4>")
    cells = [_draft_cell(rnd, tokenizer, shown, i, d) for i, d in enumerate(rnd.drafted)]
    cells += _target_cells(rnd, tokenizer, shown)
    return (f'<div class="minivllm-speculation minivllm-page">{head}'
            f"{_context_line(rnd, tokenizer, shown, prompt_token_ids, context_chars)}"
            f'<table class="minivllm-spec"><tr>{"".join(cells)}</tr></table>'
            f"{_summary_line(rnd, shown)}</div>")
