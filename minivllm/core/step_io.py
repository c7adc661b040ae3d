"""The plain data one engine step passes between its parts, in the order it flows:

    Scheduler.schedule()           -> SchedulerOutput   (what to compute: token counts, new blocks)
    ModelRunner.execute(...)       -> RunnerOutput      (what came out: sampled tokens, next drafts)
    Scheduler.update_from_output() -> EngineCoreOutput  (per request: new tokens, why it stopped)
    OutputProcessor.process(...)   -> RequestOutput     (text, for the caller)

No part hands another a live object of its own: the runner never sees a scheduler `Sequence`, the
scheduler never a tensor. Each side keeps its own per-sequence state, keyed by the sequence's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minivllm.core.sequence import FinishReason
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    """One position's logprobs: the token there, then the k most likely (vLLM's shape, as ids)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = the most likely token


@dataclass(slots=True)
class NewSequenceData:
    """Everything about a sequence the runner does not know yet: sent once, when it first runs (and
    again after a preemption took its blocks, or when beam search forked it)."""

    token_ids: list[int]  # prompt + output so far (after a preemption, everything is recomputed)
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output it may produce: drafts never run past it
    seed: int | None = None  # its own random stream's (the i-th of n samples: params.seed + i)
    eos_token_ids: tuple[int, ...] = ()  # masked while min_tokens is not reached


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of the step, as the scheduler decided it."""

    request_id: str  # the sequence's id
    num_new_tokens: int  # includes the speculative tokens, if any
    num_computed_before: int  # tokens already in the cache when this step starts
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens the target verifies
    is_prefill: bool = True  # (re)computing a prompt or a chunk of it, not the last sampled token
    samples: bool = True  # the step reaches the end of the known tokens, so its logits are sampled
    new_block_ids: list[int] = field(default_factory=list)  # for its block table (all, if `new`)
    new: NewSequenceData | None = None  # set when the runner meets this sequence (again)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # in batch order
    preempted: list[str] = field(default_factory=list)  # blocks gone; they come back whole
    finished: list[str] = field(default_factory=list)  # finished or aborted since: forget them
    # structured output: a bitmask row (bit set = allowed) per sampled position of constrained ones
    grammar_bitmask: np.ndarray | None = None  # [rows, ceil(vocab / 32)] int32
    grammar_rows: dict[str, int] = field(default_factory=dict)  # request id -> its first row
    # the runner copies these (src, dst) block pairs before the forward pass, in this order: swap
    # out, copy, swap in (a block swapped out may be reused by a copy-on-write; a swap-in may reuse
    # a block a copy just read)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, GPU)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (GPU)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def new_sequences(self) -> list[ScheduledSequence]:
        """The scheduled sequences the runner meets (again) in this step, sent whole."""
        return [s for s in self.scheduled if s.new is not None]

    def __bool__(self) -> bool:
        """Anything for the runner: work, blocks to move, or requests to forget."""
        return bool(self.scheduled or self.finished or self.preempted or self.blocks_to_swap_in
                    or self.blocks_to_copy)


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # accepted drafts + 1
    num_accepted: dict[str, int] = field(default_factory=dict)  # of the drafts verified now
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # per sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # done now
    propose_seconds: float = 0.0  # time spent drafting (a measured share of the step: chapter 07)
    # the model's forward pass and logits (on CUDA: until the launches return)
    forward_seconds: float = 0.0
    # a mixture of experts: tokens routed to each expert, one tuple per sparse layer (the trace's)
    expert_load: list[tuple[int, ...]] = field(default_factory=list)


@dataclass(slots=True)
class EngineCoreOutput:
    """What a step did to one request, for the output processor: no tensors, no live objects."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    first_scheduled_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # for new_token_ids, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # the prompt positions computed now
