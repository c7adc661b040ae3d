"""Grammars: what the scheduler asks of structured outputs, not knowing how grammars are matched.

The scheduler decides which rows of a step sample, so it builds their grammar masks and lets each
sampled token advance its sequence's grammar (a finished grammar stops the sequence). How a grammar
is compiled and matched (llguidance, over the tokenizer's vocabulary, with torch for the masks) is
minivllm/structured_output.py's business: the engine hands the scheduler one of those, and the
plain-Python core never imports it.
"""

from __future__ import annotations

from typing import Any, Protocol


class Grammars(Protocol):
    """One matcher per constrained sequence, keyed by its request id."""

    def add(self, request_id: str, spec: Any) -> None:
        """Start matching `spec` (a StructuredOutputsParams) for this sequence."""

    def free(self, request_id: str) -> None:
        """Forget the sequence's matcher (it finished)."""

    def active(self) -> bool:
        """Whether any sequence is constrained (commonly none: no masks to build)."""

    def constrains(self, request_id: str) -> bool:
        """Whether this sequence has a grammar."""

    def bitmask(self, rows: list[tuple[str, list[int]]]) -> tuple[Any, dict[str, int]]:
        """Masks for (id, drafts) pairs, 1 + len(drafts) rows each: (bitmask, id -> first row)."""

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the sequence's grammar by `token`; True when the grammar is complete."""

    def can_end(self, request_id: str) -> bool:
        """Whether the grammar could end here (an EOS token may stop the sequence)."""
