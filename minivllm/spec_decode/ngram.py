"""N-gram (prompt lookup) proposer: guess that the text will repeat itself.

Find the most recent earlier occurrence of the sequence's last n tokens and propose the tokens that
followed it. No model at all, so free to run; it shines when outputs copy from the prompt
(summaries, code edits, quoting) and simply proposes nothing when there is no match.
"""

from __future__ import annotations

from minivllm.runner.sequence_state import SequenceState
from minivllm.spec_decode.proposer import Draft


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, max_n: int = 4, min_n: int = 1) -> None:
        self.k, self.max_n, self.min_n = num_speculative_tokens, max_n, min_n

    def propose(self, requests: list[SequenceState], num_drafts: list[int]) -> list[Draft]:
        """Drafts for each request, with no distribution: a lookup is a point mass."""
        return [(self.lookup(req.token_ids, k) if k > 0 else [], None)
                for req, k in zip(requests, num_drafts)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent match first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def free(self, request_id: str) -> None:
        """Nothing to free: the lookup keeps no state."""
