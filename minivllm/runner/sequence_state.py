"""SequenceState: what the runner remembers about a sequence between steps, keyed by its id.

The scheduler sends a sequence whole once, when it first runs (or runs again after a preemption, or
was forked by beam search); afterwards only what changed: new blocks, and drafts to verify. The
runner appends the tokens it sampled itself. Torch objects live here, never on the scheduler's
`Sequence`: a seeded sequence's random generator (kept across preemptions, so its draws do not
restart) and the drafter's distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceState:
    request_id: str  # the sequence's id
    token_ids: list[int]  # prompt + output so far (no drafts); all but the newest in the cache
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int]
    max_total_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    num_prompt_logprobs_done: int = 1  # prompt positions reported (the first has none)
    generator: torch.Generator | None = None  # only when the sequence has a seed
    spec_probs: torch.Tensor | None = None  # the drafter's q per pending draft (None: point mass)
