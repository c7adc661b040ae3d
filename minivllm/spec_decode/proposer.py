"""The proposer interface: what the runner asks of any drafter (a draft model, n-gram lookup, or your own)."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.runner.request_state import RequestState

# a request's drafts, and the drafter's distribution for each (None: the drafts are point masses)
Draft = tuple[list[int], torch.Tensor | None]


class Proposer(Protocol):
    def propose(self, requests: list[RequestState], num_drafts: list[int]) -> list[Draft]:
        """Guess up to num_drafts[i] next tokens for each request (its token_ids end with its newest token)."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever the proposer keeps for it."""
        ...
