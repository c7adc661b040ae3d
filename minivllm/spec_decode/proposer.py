"""The proposer interface: what the runner asks of any drafter (draft model, n-gram, your own)."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.runner.sequence_state import SequenceState

# a request's drafts, and the drafter's distribution for each (None: the drafts are point masses)
Draft = tuple[list[int], torch.Tensor | None]


class Proposer(Protocol):
    def propose(self, requests: list[SequenceState], num_drafts: list[int]) -> list[Draft]:
        """Guess up to num_drafts[i] next tokens for each sequence: its token_ids end with its
        newest token, and the target's cache holds all but that one."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever the proposer keeps for it."""
        ...
