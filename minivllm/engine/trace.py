"""StepTrace: what one engine step did, recorded so notebooks and widgets can replay real engine state.

`LLMEngine.trace` keeps the most recent steps (`trace_steps` in the config). Each record is plain data:
who was scheduled for how many tokens (prefill or decode), which blocks were allocated, re-used from the
prefix cache or freed, who was preempted or finished, and every live block table after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledEntry:
    request_id: str
    num_tokens: int  # tokens computed for this request in this step
    kind: str  # "prefill" or "decode"
    num_computed_before: int
    sampled_token: int | None = None  # None while a chunked prefill is not finished
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step
    num_accepted: int = 0  # of those, how many the target accepted
    new_token_ids: list[int] = field(default_factory=list)  # tokens appended (accepted drafts + 1)


@dataclass
class StepTrace:
    step: int
    duration_s: float
    scheduled: list[ScheduledEntry]
    preempted: list[str]
    finished: dict[str, str]  # request id -> finish reason
    allocated: dict[str, list[int]]  # request id -> block ids taken from the free queue
    cache_hits: dict[str, list[int]]  # request id -> block ids re-used from the prefix cache
    freed: dict[str, list[int]]  # request id -> block ids given back
    block_tables: dict[str, list[int]]  # every live request's table after the step
    waiting: list[str]
    running: list[str]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int = 16
    num_computed_tokens: dict[str, int] = field(default_factory=dict)  # live request -> tokens in its blocks
    shared_blocks: dict[int, int] = field(default_factory=dict)  # block id -> ref count, where > 1

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if e.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if e.kind == "decode")


def group_events(events: list[tuple[str, str, int]], kind: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, rid, block in events:
        if k == kind:
            out.setdefault(rid, []).append(block)
    return out
