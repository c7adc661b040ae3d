"""Tokenization drawn: a text's pieces with their ids and bytes, and the engine's incremental
detokenizer stepping token by token (its prefix/read offsets and the text each step emits).

Why draw it: byte-level BPE may split one character over several tokens, so streaming text cannot
decode one token at a time; seeing a step that emits nothing makes the held-back text concrete.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from minivllm.tokenizer import Tokenizer

_CELL = "border:1px solid #999;padding:2px 5px;text-align:center;font-family:monospace"


@dataclass(frozen=True)
class DetokStep:
    """One call of Tokenizer.detokenize_step: the offsets it read and the text it emitted."""

    token_id: int
    prefix_offset: int  # window start before the call
    read_offset: int  # tokens before this were already text
    emitted: str


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
    are shifted to code points 256 and up (so "Ġ" = 0x120 is the space byte 0x20)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The raw bytes a byte-level BPE token stands for (its piece mapped back through GPT-2's
    byte-to-unicode table); a special token's bytes are its name's."""
    piece = tok.hf.convert_ids_to_tokens(token_id)
    if piece in tok.special_tokens:
        return piece.encode()
    to_byte = _byte_of_char()
    return bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece) else piece.encode()


def detok_steps(tok: Tokenizer, all_token_ids: list[int],
                num_prompt_tokens: int) -> list[DetokStep]:
    """Run the engine's own incremental detokenizer over the output tokens, one call per token."""
    state, steps = tok.start_detokenizer(num_prompt_tokens), []
    for end in range(num_prompt_tokens + 1, len(all_token_ids) + 1):
        before = (state.prefix_offset, state.read_offset)
        steps.append(DetokStep(all_token_ids[end - 1], *before,
                               tok.detokenize_step(all_token_ids[:end], state)))
    return steps


def pieces_html(tok: Tokenizer, token_ids: list[int], highlight: int | None = None) -> str:
    """One column per token: its piece, id and bytes; special tokens (BOS/EOS, the chat template's)
    grey, tokens holding only part of a character (bytes that are not valid UTF-8) red, and the
    `highlight`-th token yellow."""
    rows: dict[str, list[str]] = {"piece": [], "id": [], "bytes": []}
    for i, tid in enumerate(token_ids):
        piece, raw = tok.hf.convert_ids_to_tokens(tid), token_bytes(tok, tid)
        bg = ("#ffe08a" if i == highlight else "#d9d9d9" if piece in tok.special_tokens
              else "#ff9896" if raw.decode(errors="replace") != raw.decode(errors="ignore")
              else "#fff")
        for name, value in zip(rows, (html.escape(piece), tid, raw.hex(" "))):
            rows[name].append(f"<td style='{_CELL};background:{bg}'>{value}</td>")
    body = "".join(f"<tr><th style='{_CELL}'>{n}</th>{''.join(r)}</tr>" for n, r in rows.items())
    return f"<table style='border-collapse:collapse;font-size:12px'>{body}</table>"


def detok_html(tok: Tokenizer, all_token_ids: list[int], steps: list[DetokStep], index: int) -> str:
    """Step `index` of the detokenizer: the window [prefix_offset, end) over the tokens, the text
    emitted so far, and what this step emitted (or why nothing)."""
    s, num_prompt = steps[index], len(all_token_ids) - len(steps)
    end = num_prompt + index + 1
    window = pieces_html(tok, all_token_ids[s.prefix_offset:end],
                         highlight=end - 1 - s.prefix_offset)
    so_far = "".join(x.emitted for x in steps[: index + 1])
    said = (f"emitted <code>{html.escape(repr(s.emitted))}</code>" if s.emitted else
            "emitted <b>nothing</b>: the window's text ends in an unfinished character (U+FFFD), "
            "held back until its next bytes arrive")
    return (f'<div class="minivllm-page"><h4>token {index + 1} of {len(steps)} (id {s.token_id})'
            f"</h4><div>prefix_offset={s.prefix_offset}, read_offset={s.read_offset}, window = "
            f"tokens {s.prefix_offset}..{end - 1}; {said}</div>{window}<div>text so far: <code>"
            f"{html.escape(repr(so_far))}</code></div></div>")
