"""Scheduler: which requests run this step, how many tokens each, and what the results mean.

`schedule()`: running requests come first (a decode is 1 token; a half-prefilled prompt continues
its next chunk), so streams already under way stay smooth; then waiting requests are admitted in
queue order, their prompts cut into chunks that fit what is left of `max_num_batched_tokens`.

The queue order is the policy (scheduling_policy.py): "fcfs", "priority" (vLLM's: lower `priority`
first, and an urgent waiting request may preempt running work of lower priority), "sjf" (least
predicted work first, with aging) or "round_robin" (a running request yields its slot after a
quantum of tokens when others wait).

When the KV cache runs out of blocks, a running request is preempted (the policy says which: the
newest under "fcfs"). By *recompute* its blocks are freed and it goes back to the waiting queue
(its head under "fcfs") to be prefilled again later (prompt plus what it already wrote). By *swap*
(swap.py), its computed blocks are first copied to host memory and copied back when it resumes, so
it keeps its `num_computed_tokens`. Either way a request preempted in a step is not readmitted in
that step.

`update_from_output()`: the runner's sampled tokens are appended, rejected drafts are not counted as
computed, and the token-level stop conditions (EOS, stop token ids, length) finish requests and free
their blocks. Stop *strings* are text: the output processor finds them and calls `finish_requests`.
"""

from __future__ import annotations

import time
from collections import deque

from minivllm.core.grammar import Grammars
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduling_policy import SchedulingPolicy, make_policy
from minivllm.core.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.core.step_io import (
    EngineCoreOutput,
    NewSequenceData,
    RunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
)
from minivllm.core.swap import SwapSpace
from minivllm.hooks import EngineHooks

# A prompt that asks for prompt_logprobs costs a log-softmax over the vocabulary and a top-k per
# position: with chunked prefill it is computed at most this many positions a step, so one such
# sequence cannot stall everyone's step for seconds (1000 positions with 20 logprobs took 1.4 s of
# one step on the 2-core test machine).
PROMPT_LOGPROBS_TOKENS_PER_STEP = 256


def prefill_chunk(num_remaining: int, budget: int, enable_chunked_prefill: bool) -> int:
    """How many of a waiting sequence's remaining tokens this step computes with `budget` left: all
    if they fit, else a chunk filling the budget (chunked prefill), or 0 (it waits) unchunked."""
    if num_remaining <= budget:
        return num_remaining
    return budget if enable_chunked_prefill else 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 policy: str | SchedulingPolicy = "fcfs", swap: SwapSpace | None = None,
                 structured: Grammars | None = None, hooks: EngineHooks | None = None) -> None:
        """`policy`: a SchedulingPolicy or its name (scheduling_policy.py); `swap`: where preempted
        blocks go (None: by recompute); `structured`: grammars of structured-output requests (None
        without a tokenizer); `hooks`: a learner's own queue rule or prefill chunking
        (minivllm.hooks), None: the engine's."""
        hooks = hooks or EngineHooks()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.enqueue_into = hooks.enqueue or self.policy.enqueue
        self.prefill_chunk = hooks.prefill_chunk or prefill_chunk
        self.victim_of = hooks.preempt_victim or self.policy.victim
        self.kv = kv
        self.structured = structured
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swap = swap
        self.waiting: deque[Sequence] = deque()  # in policy order: the head is admitted next
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock "sjf" ages waiting sequences by
        self._left_waiting = False  # the last admission left runnable sequences in the queue
        self._finished_ids: list[str] = []  # finished since the runner last heard: it drops them

    def add(self, seq: Sequence) -> None:
        if seq.params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need a tokenizer, and this model has none")
            self.structured.add(seq.request_id, seq.params.structured_outputs)
        self.sequences[seq.request_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, preempted: bool = False) -> None:
        """Into the waiting queue at its place, by the policy's rule (SchedulingPolicy.enqueue)."""
        seq.enqueued_step = self.num_steps
        self.enqueue_into(self.waiting, seq, preempted)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- 1. what to compute ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.num_steps += 1
        if self._left_waiting:  # "round_robin": who used up their quantum makes room
            for seq in [s for s in self.running if self.policy.yields(s)]:
                self._preempt(seq, out)
        yielded = len(out.preempted)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if len(out.preempted) == yielded:  # running sequences preempted for blocks: admit nobody
            self.policy.order(self.waiting, self.num_steps)
            self._admit_waiting(out, budget)
        self._left_waiting = bool(self.waiting)
        out.blocks_to_copy = self.kv.drain_copies()
        out.finished, self._finished_ids = self._finished_ids, []
        if self.structured is not None and self.structured.active():
            constrained = [(s.request_id, s.spec_token_ids) for s in out.scheduled
                           if s.samples and self.structured.constrains(s.request_id)]
            if constrained:
                out.grammar_bitmask, out.grammar_rows = self.structured.bitmask(constrained)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """1. Running sequences, oldest first: decodes and unfinished prefill chunks, preempting the
        newest (or lowest-priority) when blocks run out. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, self._prefill_budget(seq, budget))
            if n <= 0:  # a beam whose logits are in, waiting for its siblings' (beam_search.py)
                i += 1
                continue
            # a decode verifies its drafts in the same pass, as far as the budget allows
            spec = seq.spec_token_ids[: budget - n] if n == 1 else []
            num_blocks = len(self.kv.block_tables.get(seq.request_id, ()))
            while not self.kv.allocate(seq, n + len(spec)):
                victim = self._victim()
                if self.running.index(victim) < i:  # already scheduled in this step: taken back
                    i -= 1
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._entry(seq, n + len(spec), spec, num_blocks))
                budget -= n + len(spec)
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """2. Waiting sequences in policy order, each with its cached prefix (or swapped-out blocks)
        and a prefill chunk that fits the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_id in out.preempted:  # preempted in this step: not back before the next
                break
            swapped = self.swap is not None and self.swap.is_swapped(seq)
            cached = [] if swapped else self.kv.find_cached_prefix(seq)
            num_done = (seq.num_computed_tokens if swapped
                        else self.kv.num_logical_blocks(cached) * self.kv.block_size)
            n = self.prefill_chunk(seq.num_tokens - num_done, self._prefill_budget(seq, budget),
                                   self.enable_chunked_prefill)
            if n <= 0:
                break
            swap_in = self.swap.swap_in(self.kv, seq, n) if swapped else None
            if not (swap_in is not None if swapped else self.kv.allocate(seq, n, cached)):
                victim = self._victim(outranked_by=seq)
                if victim is None:
                    break
                budget += self._preempt(victim, out)
                continue
            out.blocks_to_swap_in += swap_in or []
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:  # the first time it is scheduled, not after a preemption
                seq.num_cached_tokens = num_done
                seq.first_scheduled_time = time.monotonic()
                self.kv.record_prefix_lookup(seq.num_prompt_tokens, num_done)
            seq.num_computed_tokens = num_done
            seq.outputs_at_admission = len(seq.output_token_ids)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._entry(seq, n, [], 0))
            budget -= n

    def fork(self, parent: Sequence, child_id: str, token: int) -> Sequence:
        """A new sequence: the parent's tokens plus `token` (beam search). A running parent's blocks
        are shared by reference (kv.fork) and copied on write; a parent that was preempted meanwhile
        has none, so the child waits to be computed from scratch."""
        child = Sequence(child_id, parent.prompt_token_ids, parent.params, parent.eos_token_ids,
                         parent.max_model_len, parent.arrival_time,
                         [*parent.output_token_ids, token], parent_id=parent.parent_id,
                         index=parent.index, priority=parent.priority,
                         block_hashes=list(parent.block_hashes),
                         external_sampling=parent.external_sampling,
                         num_cached_tokens=parent.num_cached_tokens,
                         first_scheduled_time=parent.first_scheduled_time)
        self.sequences[child_id] = child
        if parent.status is SequenceStatus.RUNNING:
            self.kv.fork(parent.request_id, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)  # the runner meets it, table and all, when first scheduled
        else:
            self._enqueue(child, preempted=True)
        return child

    def _prefill_budget(self, seq: Sequence, budget: int) -> int:
        """The step's budget as one sequence may use it: less for a prompt with prompt_logprobs."""
        if seq.params.prompt_logprobs is None or not self.enable_chunked_prefill or \
                seq.num_computed_tokens >= seq.num_prompt_tokens:
            return budget
        return min(budget, PROMPT_LOGPROBS_TOKENS_PER_STEP)

    def _entry(self, seq: Sequence, num_new: int, spec: list[int],
               num_known_blocks: int) -> ScheduledSequence:
        """The sequence's share of this step: for the runner, the blocks its table gained since the
        last step, or, if it does not know the sequence (yet, or any more), the whole of it."""
        before, table = seq.num_computed_tokens, self.kv.block_tables[seq.request_id]
        decode = (num_new == 1 + len(spec) and bool(seq.output_token_ids)
                  and before == seq.num_tokens - 1)
        new_blocks = table[num_known_blocks:] if seq.runner_knows else list(table)
        entry = ScheduledSequence(seq.request_id, num_new, before, list(spec),
                                  is_prefill=not decode, new_block_ids=new_blocks,
                                  samples=before + num_new - len(spec) == seq.num_tokens)
        if not seq.runner_knows:
            entry.new = NewSequenceData(list(seq.all_token_ids), seq.num_prompt_tokens, seq.params,
                                        seq.max_total_tokens, seq.sample_seed, seq.eos_token_ids)
            seq.runner_knows = True
        return entry

    def _victim(self, outranked_by: Sequence | None = None) -> Sequence | None:
        """Whom to preempt when blocks run out, by the policy: for a running sequence, someone
        always (maybe itself); for a waiting one (`outranked_by`), only whom the policy says it
        outranks ("priority"), else None: it waits."""
        return self.victim_of(self.running, outranked_by)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Take a running sequence's blocks back, by swap when the host has room, else by recompute.
        If this step already scheduled it, that is undone; returns the token budget given back."""
        self.running.remove(seq)
        entry = next((s for s in out.scheduled if s.request_id == seq.request_id), None)
        if entry is not None:
            out.scheduled.remove(entry)
        seq.runner_knows = False  # it comes back whole: the runner rebuilds its state then
        swap_out = self.swap.swap_out(self.kv, seq) if self.swap is not None else None
        if swap_out is None:  # recompute: everything it had computed is gone
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        else:
            out.blocks_to_swap_out += swap_out
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self._enqueue(seq, preempted=True)  # fcfs puts it back at the head
        out.preempted.append(seq.request_id)
        self.num_preemptions += 1
        return entry.num_new_tokens if entry is not None else 0

    # ---- 2. what the step's results mean ---------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advance each scheduled sequence by what the runner computed; finish any that hit a stop.
        K/V written for rejected drafts is rolled back simply by not counting it: the next step
        overwrites those slots (and drafts are never hashed into the prefix cache)."""
        outputs = []
        for s in sched.scheduled:
            seq = self.sequences[s.request_id]
            tokens = result.sampled_token_ids.get(s.request_id, [])
            if seq.external_sampling:  # beam search reads the logits and picks the token itself
                seq.num_computed_tokens += s.num_new_tokens
                continue
            # rejected drafts' K/V is not counted
            num_accepted = result.num_accepted.get(s.request_id, 0)
            seq.num_computed_tokens += s.num_new_tokens - (len(s.spec_token_ids) - num_accepted)
            seq.num_spec_accepted += num_accepted
            seq.spec_token_ids = []
            prompt_logprobs = result.prompt_logprobs.get(s.request_id)
            if not tokens and prompt_logprobs is None:  # a prefill chunk short of the prompt's end
                continue
            new = []
            for token in tokens:
                seq.append_output(token)
                new.append(token)
                reason = self._check_stop(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            # a stop inside the drafts
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            logprobs = result.logprobs.get(s.request_id)
            outputs.append(EngineCoreOutput(
                seq.request_id, new, seq.finish_reason, seq.stop_reason,
                max(seq.num_cached_tokens, 0), seq.num_preemptions, seq.num_spec_proposed,
                seq.num_spec_accepted, seq.first_scheduled_time,
                logprobs[: len(new)] if logprobs is not None else None, prompt_logprobs))
        for rid, drafts in result.spec_token_ids.items():
            seq = self.sequences.get(rid)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.spec_token_ids = drafts
                seq.num_spec_proposed += len(drafts)
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        """The stops a token id alone decides (stop strings need text: the output processor's)."""
        params = seq.params
        constrained = params.structured_outputs is not None
        if constrained and self.structured.accept(seq.request_id, token):
            return FinishReason.STOP  # the grammar is complete: nothing more may follow
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        # an EOS id ends a constrained output only where the grammar could end (a checkpoint may
        # name a plain text token as EOS, which the grammar then allows as text)
        if not params.ignore_eos and token in seq.eos_token_ids and (
                not constrained or self.structured.can_end(seq.request_id)):
            return FinishReason.STOP
        if seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    # ---- 3. leaving ------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason,
               stop_reason: int | str | None = None) -> None:
        """Retire a sequence (stop, length or abort) from wherever it is, and return its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if self.swap is not None:
            self.swap.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        del self.sequences[seq.request_id]
        self._finished_ids.append(seq.request_id)
        if self.structured is not None:
            self.structured.free(seq.request_id)
        self.policy.finished(seq)

    def finish_requests(self, request_ids: list[str], reason: FinishReason,
                        stop_reasons: dict[str, int | str] | None = None) -> None:
        """Finish requests by id (aborts, stop strings); ids already gone are ignored."""
        for rid in request_ids:
            if rid in self.sequences:
                self.finish(self.sequences[rid], reason, (stop_reasons or {}).get(rid))
