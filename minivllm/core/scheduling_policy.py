"""Scheduling policies: the order of the waiting queue, whom to preempt, and when to yield a slot.

The scheduler (scheduler.py) does the same work under every policy: running sequences first, then
waiting ones admitted from the head of the queue while slots, blocks and the token budget last.
A policy only decides three things:

- `enqueue` / `order`: where a new or preempted sequence stands in the waiting queue;
- `victim`: which running sequence gives its blocks back when the cache runs out;
- `yields`: whether a running sequence gives its slot up so that a waiting one can run.

"fcfs" is arrival order. "priority" is vLLM's: lower `priority` first, ties by arrival, and a
waiting request may push out running work of lower priority. "sjf" (shortest job first) admits the
request with the least predicted work left, so short requests are not stuck behind long ones; its
prediction is `OutputLengthEstimator` unless `EngineHooks.predict_output_tokens` replaces it, and it
ages: a request waiting `aging_steps` steps goes ahead of every younger one, so a long job waits at
most that long plus its turn among the aged. "round_robin" shares the slots: once more sequences
are runnable than fit, a running sequence that produced `quantum` tokens since it was admitted is
preempted (recompute or swap, as configured) and rejoins the back of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from minivllm.core.sequence import FinishReason, Sequence


class SchedulingPolicy:
    """First come, first served; the base the other policies change."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, preempted: bool) -> None:
        """A new sequence joins the tail; a preempted one goes back to the head, since it is older
        than everyone still waiting (so requests that arrived after it do not overtake it)."""
        if preempted:
            waiting.appendleft(seq)
        else:
            waiting.append(seq)

    def order(self, waiting: deque[Sequence], step: int) -> None:
        """Re-sort the queue before admission (only a policy whose order changes with time)."""

    def victim(self, running: list[Sequence], outranked_by: Sequence | None) -> Sequence | None:
        """The newest running sequence gives its blocks back; a waiting one preempts nobody."""
        return running[-1] if outranked_by is None else None

    def yields(self, seq: Sequence) -> bool:
        return False

    def finished(self, seq: Sequence) -> None:
        """A sequence left (what a learning policy learns from)."""


class PriorityPolicy(SchedulingPolicy):
    """vLLM's "priority": (priority, arrival) order, preempting the largest key."""

    name = "priority"

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, preempted: bool) -> None:
        key = seq.priority_key
        place = next((i for i, r in enumerate(waiting) if r.priority_key > key), len(waiting))
        waiting.insert(place, seq)

    def victim(self, running: list[Sequence], outranked_by: Sequence | None) -> Sequence | None:
        if not running:
            return None
        victim = max(running, key=lambda r: r.priority_key)
        if outranked_by is None or victim.priority_key > outranked_by.priority_key:
            return victim
        return None


class OutputLengthEstimator:
    """How many tokens a request will generate, learned from the requests that finished.

    Prompts are grouped by length (powers of two: 1, 2-3, 4-7, ...): a server sees the same kinds of
    request again and again, and their answers tend to run alike. Each group keeps a moving average
    of its output lengths; the prediction is that average, capped by the request's own `max_tokens`,
    or `max_tokens` itself for a group never seen.
    """

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight  # how much the newest finished request moves its group's average
        self.averages: dict[int, float] = {}

    def __call__(self, seq: Sequence) -> int:
        cap = seq.max_total_tokens - seq.num_prompt_tokens
        average = self.averages.get(seq.num_prompt_tokens.bit_length())
        return cap if average is None else min(cap, round(average))

    def observe(self, seq: Sequence) -> None:
        group, n = seq.num_prompt_tokens.bit_length(), len(seq.output_token_ids)
        old = self.averages.get(group)
        self.averages[group] = n if old is None else old + self.weight * (n - old)


class ShortestJobFirst(SchedulingPolicy):
    """Least predicted work first: prompt tokens still to compute plus output tokens still to come.
    A request that has waited `aging_steps` steps goes ahead of all younger ones (arrival order
    among the aged): that bounds every wait."""

    name = "sjf"

    def __init__(self, aging_steps: int, predict: Callable[[Sequence], int] | None = None) -> None:
        self.aging_steps = aging_steps
        self.estimator = OutputLengthEstimator()
        self.predict = predict or self.estimator

    def work(self, seq: Sequence) -> int:
        """Tokens this sequence still has to compute, by the prediction."""
        outputs_left = max(self.predict(seq) - len(seq.output_token_ids), 1)
        return max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) + outputs_left

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, preempted: bool) -> None:
        waiting.append(seq)  # `order` puts it in its place before the next admission

    def order(self, waiting: deque[Sequence], step: int) -> None:
        def key(seq: Sequence) -> tuple:
            if step - seq.enqueued_step >= self.aging_steps:
                return (0, seq.arrival_time, 0)
            return (1, self.work(seq), seq.arrival_time)

        ordered = sorted(waiting, key=key)
        waiting.clear()
        waiting.extend(ordered)

    def victim(self, running: list[Sequence], outranked_by: Sequence | None) -> Sequence | None:
        """The running sequence with the most work left gives its blocks back."""
        return max(running, key=self.work) if outranked_by is None and running else None

    def finished(self, seq: Sequence) -> None:
        if seq.finish_reason is not FinishReason.ABORT:
            self.estimator.observe(seq)


class RoundRobin(SchedulingPolicy):
    """Arrival order, and slots shared: when sequences are left waiting, a running one that produced
    `quantum` tokens since it was admitted yields (preempted, to the back of the queue). Each
    admission therefore yields at least `quantum` tokens (or finishes the sequence): everyone makes
    progress."""

    name = "round_robin"

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum

    def enqueue(self, waiting: deque[Sequence], seq: Sequence, preempted: bool) -> None:
        waiting.append(seq)

    def yields(self, seq: Sequence) -> bool:
        produced = len(seq.output_token_ids) - seq.outputs_at_admission
        return not seq.external_sampling and produced >= self.quantum


POLICIES = ("fcfs", "priority", "sjf", "round_robin")


def make_policy(name: str, quantum: int = 16, aging_steps: int = 256,
                predict: Callable[[Sequence], int] | None = None) -> SchedulingPolicy:
    """The policy a `scheduling_policy` names (EngineConfig checks the name)."""
    if name == "priority":
        return PriorityPolicy()
    if name == "sjf":
        return ShortestJobFirst(aging_steps, predict)
    if name == "round_robin":
        return RoundRobin(quantum)
    return SchedulingPolicy()
