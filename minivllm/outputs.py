"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position, its rank there (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: token id -> Logprob (the chosen token and the top k)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: SampleLogprobs | None = None  # when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # their sum (same condition)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    spec_num_proposed: int = 0  # draft tokens proposed for this request (speculative decoding)
    spec_num_accepted: int = 0  # of which the target accepted

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # if prompt_logprobs is set
