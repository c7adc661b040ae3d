"""Scheduler: which requests run this step, and how many tokens each, within a token budget.

Running requests come first (a decode is 1 token; a half-prefilled prompt continues its next chunk), so
streams already under way stay smooth; then waiting requests are admitted first come, first served,
their prompts cut into chunks that fit what is left of `max_num_batched_tokens`. When the KV cache runs
out of blocks, the newest running request is preempted by recompute: its blocks are freed and it goes
back to the head of the waiting queue, to be prefilled again later (prompt plus what it already wrote).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes the speculative tokens, if any
    num_computed_before: int  # tokens already in the cache when this step starts
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens the target verifies

    @property
    def is_prefill(self) -> bool:
        """Decode = computing the one token sampled last step (plus drafts); anything else is (re)prefill."""
        req = self.request
        return not (self.num_new_tokens == 1 + len(self.spec_token_ids) and req.output_token_ids and
                    self.num_computed_before == req.num_tokens - 1)

    @property
    def samples(self) -> bool:
        """Only a step that reaches the end of the sequence produces logits worth sampling."""
        return self.num_computed_before + self.num_new_tokens - len(self.spec_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # a decoding request with drafts verifies them in the same pass, as far as the budget allows
            spec = req.spec_token_ids[: budget - n] if n == 1 else []
            n += len(spec)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()  # the newest request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, spec))
                budget -= n
                i += 1

        # 2. Waiting requests, first come first served, unless this step already had to preempt.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - num_cached
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # the first time it is scheduled, not after a preemption
                req.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, num_cached))
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_after_step(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """The runner computed the scheduled tokens: advance each request.

        K/V written for rejected draft tokens is rolled back simply by not counting it: the next step
        overwrites those slots (and drafts are never hashed into the prefix cache).
        """
        num_rejected = num_rejected or {}
        for s in out.scheduled:
            req = s.request
            computed = req.num_computed_tokens + s.num_new_tokens - num_rejected.get(req.request_id, 0)
            req.num_computed_tokens = min(computed, req.num_tokens)  # a stop inside the accepted drafts
            req.spec_token_ids = []

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (stop, length or abort) from wherever it is, and return its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
