"""StepTrace: what one engine step did, recorded so notebooks and widgets replay real engine state.

`TraceRecorder` is a step observer: after every step the engine hands it a `StepRecord` (the step's
plain data) and it keeps the most recent `trace_steps` as StepTraces in `LLMEngine.trace`. Each is
plain data: who was scheduled for how many tokens (prefill or decode), which blocks were allocated,
re-used from the prefix cache, freed, or swapped to and from host memory, who was preempted or
finished, every live block table after the step, and for a mixture of experts the tokens each
expert received in each sparse layer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.core.kv_cache_manager import KVCacheManager, KVEvent
from minivllm.core.sequence import FinishReason
from minivllm.core.step_io import EngineCoreOutput, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine


@dataclass
class StepRecord:
    """Everything one step produced, for each step observer (trace, counters, a chapter's own)."""

    step: int
    duration_s: float
    scheduler_output: SchedulerOutput
    runner_output: RunnerOutput
    core_outputs: list[EngineCoreOutput]
    finished: dict[str, FinishReason]  # sequence id -> why it ended (token stops and stop strings)
    kv_events: list[KVEvent]
    # wall seconds of each part of the step: schedule, run (the runner; its forward pass is in
    # runner_output), update (scheduler bookkeeping), output (detokenize, stops, RequestOutputs)
    phase_seconds: dict[str, float] = field(default_factory=dict)


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
    # every live request's table after the step, -1 where a sliding window's block went back; with
    # several groups of layers (core/kv_groups.py) interleaved: logical block j of group g at
    # j * num_kv_groups + g
    block_tables: dict[str, list[int]]
    waiting: list[str]
    running: list[str]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int = 16
    num_computed_tokens: dict[str, int] = field(default_factory=dict)  # live request -> tokens
    shared_blocks: dict[int, int] = field(default_factory=dict)  # block id -> ref count, where > 1
    # request id -> GPU blocks copied to the host, GPU blocks filled from the host, the blocks a new
    # sequence shares with its parent (forked), its copy-on-write blocks (the copies)
    swapped_out: dict[str, list[int]] = field(default_factory=dict)
    swapped_in: dict[str, list[int]] = field(default_factory=dict)
    forked: dict[str, list[int]] = field(default_factory=dict)
    copied: dict[str, list[int]] = field(default_factory=dict)
    num_swap_bytes: int = 0  # KV bytes this step moved between GPU and host, both ways
    num_free_host_blocks: int = 0
    num_total_host_blocks: int = 0
    # a mixture of experts: tokens routed to each expert in this step, one tuple per sparse layer
    # (empty for a dense model)
    expert_load: list[tuple[int, ...]] = field(default_factory=list)
    num_kv_groups: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if e.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_tokens for e in self.scheduled if e.kind == "decode")


def group_events(events: list[KVEvent], kind: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, rid, block in events:
        if k == kind:
            out.setdefault(rid, []).append(block)
    return out


def scheduled_entries(record: StepRecord) -> list[ScheduledEntry]:
    """Each scheduled request's line of the step: its work, the drafts it verified and the tokens it
    got."""
    accepted = record.runner_output.num_accepted
    appended = {c.request_id: c.new_token_ids for c in record.core_outputs}
    entries = []
    for s in record.scheduler_output.scheduled:
        kind = "prefill" if s.is_prefill else "decode"
        entry = ScheduledEntry(s.request_id, s.num_new_tokens, kind, s.num_computed_before,
                               spec_token_ids=list(s.spec_token_ids))
        tokens = appended.get(s.request_id)
        if tokens:
            entry.new_token_ids, entry.sampled_token = list(tokens), tokens[-1]
            entry.num_accepted = accepted.get(s.request_id, 0)
        entries.append(entry)
    return entries


class TraceRecorder:
    """The step observer behind `LLMEngine.trace`: the last `max_steps` steps, as StepTraces."""

    def __init__(self, max_steps: int) -> None:
        self.steps: deque[StepTrace] = deque(maxlen=max_steps)
        # id -> (live table, (length, blocks passed), copy)
        self._snapshots: dict[str, tuple[list[int], tuple[int, int], list[int]]] = {}

    def __call__(self, engine: LLMEngine, record: StepRecord) -> None:
        if self.steps.maxlen == 0:
            return
        kv, scheduler = engine.kv, engine.scheduler
        pool, events = kv.pool, record.kv_events
        tables = self._table_snapshots(kv)
        self.steps.append(StepTrace(
            step=record.step, duration_s=record.duration_s, scheduled=scheduled_entries(record),
            preempted=list(record.scheduler_output.preempted), finished=dict(record.finished),
            allocated=group_events(events, "alloc"), cache_hits=group_events(events, "hit"),
            freed=group_events(events, "free"), block_tables=tables,
            waiting=[r.request_id for r in scheduler.waiting],
            running=[r.request_id for r in scheduler.running], num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks, block_size=kv.block_size,
            num_computed_tokens={r.request_id: r.num_computed_tokens for r in scheduler.running},
            # a block used by several requests is in several tables: no need to scan the whole pool
            shared_blocks={b: pool.blocks[b].ref_cnt for t in tables.values() for b in t
                           if b >= 0 and pool.blocks[b].ref_cnt > 1},
            num_kv_groups=kv.num_groups,
            forked=group_events(events, "fork"), copied=group_events(events, "cow"),
            swapped_out=group_events(events, "swap_out"),
            swapped_in=group_events(events, "swap_in"),
            num_swap_bytes=engine.runner.bytes_per_block
            * (len(record.scheduler_output.blocks_to_swap_out)
               + len(record.scheduler_output.blocks_to_swap_in)),
            num_free_host_blocks=engine.swap.num_free_blocks,
            num_total_host_blocks=engine.swap.num_blocks,
            expert_load=record.runner_output.expert_load))

    def _table_snapshots(self, kv: KVCacheManager) -> dict[str, list[int]]:
        """Copies of the block tables, reusing last step's copy of every table that did not change.

        A table only grows (appends), and loses blocks to the window from its start, until it is
        freed whole: the same list with the same length and the same number of blocks passed holds
        the same blocks. Most steps change no table of most requests: this keeps the trace's memory
        and time per step small at large batch sizes. (Copies are shared between steps: read them,
        never edit.)
        """
        previous, self._snapshots = self._snapshots, {}
        for rid, table in kv.block_tables.items():
            old, key = previous.get(rid), (len(table), kv.num_dropped.get(rid, 0))
            unchanged = old is not None and old[0] is table and old[1] == key
            self._snapshots[rid] = old if unchanged else (table, key, kv.table_with_gaps(rid))
        return {rid: copy for rid, (_, _, copy) in self._snapshots.items()}
