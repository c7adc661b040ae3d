"""Sequence: one sequence as the scheduler sees it, waiting -> running -> finished (and back).

A user's request asks for `n` completions of one prompt: the engine runs each as its own sequence
(the input processor makes them; `parent_id` names the request). Plain data only (token ids,
counters, status): the runner keeps its own per-sequence state (random generator, draft
probabilities) and the output processor its own (text, detokenizer), each keyed by sequence id.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minivllm.core.block_hash import BlockHash
from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, after its blocks were taken back
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended, as OpenAI's API and vLLM's outputs say it ("abort" only vLLM's)."""

    STOP = "stop"  # EOS, a stop token id, a stop string, or a completed grammar
    LENGTH = "length"  # max_tokens or the model's window
    ABORT = "abort"  # the caller cancelled it

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)  # a sequence is itself, not its contents: `in` and `remove` compare identity
class Sequence:
    """Everything the scheduler needs to know about one sequence. `num_computed_tokens` is the heart
    of it: tokens whose K/V are in the cache. A step schedules `num_tokens - num_computed_tokens`
    more (the whole prompt, a chunk of it, or the one token sampled last step), so prefill, chunked
    prefill, decode and recompute after preemption are one rule."""

    # its id in every table: the user's request id, or "id#i" for the i-th of n completions
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # every id that ends it (unless params.ignore_eos)
    max_model_len: int = 2048
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache, set on first schedule
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    parent_id: str | None = None  # the user's request id (they differ when SamplingParams.n > 1)
    index: int = 0  # which of the n completions this is
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    priority: int = 0  # with scheduling_policy="priority": lower runs first (vLLM's meaning)
    enqueued_step: int = 0  # the scheduler step it last joined the waiting queue ("sjf" ages it)
    outputs_at_admission: int = 0  # its output tokens when last admitted ("round_robin"'s quantum)
    block_hashes: list[BlockHash] = field(default_factory=list)  # its full blocks' names
    # beam search picks the next token itself: a step computes the logits, appends nothing
    external_sampling: bool = False
    runner_knows: bool = False  # the runner holds its state (not before first sent, or preempted)
    # prompt + output as one list, kept in step by append_output: read every step, so never rebuilt
    all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        if self.parent_id is None:
            self.parent_id = self.request_id

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    @property
    def priority_key(self) -> tuple[int, float]:
        """Place in a priority queue: lower first, ties by arrival (the largest is preempted)."""
        return self.priority, self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def sample_seed(self) -> int | None:
        """Its own random stream's seed: the i-th of n samples of a seeded request gets seed + i."""
        return None if self.params.seed is None else self.params.seed + self.index

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most output this sequence may produce, capped by the model's window."""
        if self.params.max_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.num_prompt_tokens + self.params.max_tokens)
