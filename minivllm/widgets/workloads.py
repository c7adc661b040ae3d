"""Drive a real engine with requests that arrive over time, and measure what its trace recorded.

`run_arrivals` is a clock, not a scheduler: at each tick it hands the engine the requests that
arrived (continuous batching: the engine's own scheduler decides), or, for the static-batching
baseline, holds them back until the whole previous batch has finished. Every step is a real
`LLMEngine.step()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.trace import StepTrace
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class Arrival:
    request_id: str
    arrival: int  # clock tick at which the request shows up
    prompt: PromptType
    params: SamplingParams


@dataclass
class Recording:
    policy: str
    steps: list[StepTrace]  # the engine's trace of this run
    clock: list[int]  # the tick each of those steps ran at
    arrivals: dict[str, int]
    admitted: dict[str, int] = field(default_factory=dict)  # request -> tick it was handed over
    finished: dict[str, int] = field(default_factory=dict)  # request -> tick of its last step
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def num_ticks(self) -> int:
        return max(self.finished.values(), default=-1) + 1

    def latency(self, request_id: str) -> int:
        """Ticks from arrival to the end of the step that finished it."""
        return self.finished[request_id] - self.arrivals[request_id] + 1


def new_steps(engine: LLMEngine, since_step: int) -> list[StepTrace]:
    """The recorded steps from `since_step` on (the trace keeps a window of recent steps)."""
    steps = [t for t in engine.trace if t.step >= since_step]
    if engine.num_steps > since_step and (not steps or steps[0].step != since_step):
        raise ValueError(f"step {since_step} is no longer in the trace (it keeps "
                         f"{engine.trace.maxlen} steps)")
    return steps


def run_arrivals(engine: LLMEngine, arrivals: list[Arrival], policy: str = "continuous",
                 batch_size: int = 2, max_ticks: int = 10_000) -> Recording:
    """Run the workload tick by tick, one engine step per tick while anything is unfinished.

    policy "continuous": each request is added to the engine at its arrival tick.
    policy "static": requests are grouped in arrival order into batches of `batch_size`; a batch is
    handed over only when it is complete (all its requests have arrived; the last may be smaller)
    and the engine has finished everything before it.
    """
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
    if engine.has_unfinished_requests():
        raise ValueError("the engine is busy: run the workload on an idle engine")
    pending = sorted(arrivals, key=lambda a: a.arrival)
    rec = Recording(policy, [], [], {a.request_id: a.arrival for a in arrivals})
    first_step = engine.num_steps
    for tick in range(max_ticks):
        if policy == "continuous":
            batch = [a for a in pending if a.arrival <= tick]
        else:
            batch = pending[:batch_size]
            if engine.has_unfinished_requests() or any(a.arrival > tick for a in batch):
                batch = []
        for a in batch:
            engine.add_request(a.request_id, a.prompt, a.params)
            rec.admitted[a.request_id] = tick
            pending.remove(a)
        if engine.has_unfinished_requests():
            before = engine.num_steps
            for out in engine.step():
                if out.finished:
                    rec.outputs[out.request_id] = out
                    rec.finished[out.request_id] = tick
            rec.clock += [tick] * (engine.num_steps - before)
        if not pending and not engine.has_unfinished_requests():
            break
    else:
        raise RuntimeError(f"workload not done after {max_ticks} ticks")
    rec.steps = new_steps(engine, first_step)
    return rec


@dataclass
class Occupancy:
    """KV memory at the end of one step: slots reserved in blocks versus tokens actually stored."""

    step: int
    num_requests: int
    blocks: int  # distinct physical blocks in some block table
    slots: int  # blocks x block_size
    tokens: int  # token positions whose K/V are stored in those blocks

    @property
    def paged_waste(self) -> float:
        return 1 - self.tokens / self.slots if self.slots else 0.0

    def static_waste(self, max_model_len: int) -> float:
        """The waste if each live request had reserved max_model_len slots up front instead."""
        reserved = self.num_requests * max_model_len
        return 1 - self.tokens / reserved if reserved else 0.0


def kv_occupancy(steps: list[StepTrace], block_size: int | None = None) -> list[Occupancy]:
    """Per step: how many block slots the live block tables reserve and how many hold a token.

    A request's stored tokens are the engine's own count after the step (`num_computed_tokens` in
    the trace). Logical block j holds min(block_size, stored - j * block_size) tokens, in every
    group of layers (a table interleaves the groups'); a block shared by several tables (prefix
    caching) is counted once, and one a sliding window gave back (-1) not at all.
    """
    out = []
    for t in steps:
        size = block_size or t.block_size
        in_block: dict[int, int] = {}
        for rid, table in t.block_tables.items():
            n = t.num_computed_tokens.get(rid, 0)
            for i, block_id in enumerate(table):
                if block_id >= 0:
                    held = max(0, min(size, n - i // t.num_kv_groups * size))
                    in_block[block_id] = max(in_block.get(block_id, 0), held)
        out.append(Occupancy(t.step, len(t.block_tables), len(in_block), len(in_block) * size,
                             sum(in_block.values())))
    return out
