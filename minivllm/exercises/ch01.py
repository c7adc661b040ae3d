"""Chapter 01 exercise: first come, first served: where a request goes in the waiting queue.

The checker tries the rule on a queue alone, then runs the real engine with it on random workloads
with tight pools (hypothesis), where requests get preempted, checking after every step that no
request was admitted ahead of one that arrived before it, and that every request finishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import SimpleNamespace

from minivllm.exercises.common import for_all_workloads, run_workload
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks


class ArrivalOrder:
    """A step observer: no request is admitted while one that arrived before it still waits."""

    def __init__(self, workload: dict) -> None:
        reqs = workload["requests"]  # ranked by arrival step, then as added
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i][2], i))
        self.rank = {str(i): k for k, i in enumerate(order)}
        self.preempted: set[str] = set()

    def __call__(self, engine, record) -> None:
        self.preempted.update(record.scheduler_output.preempted)
        for new in record.scheduler_output.new_sequences:
            for r in engine.scheduler.waiting:
                if self.rank[r.request_id] < self.rank[new.request_id]:
                    why = ", was preempted" if r.request_id in self.preempted else ""
                    raise ExerciseFailure(f"in step {record.step}, request '{new.request_id}' was "
                                          f"admitted while request '{r.request_id}', which arrived "
                                          f"before it{why} and still waits, was not: first come, "
                                          f"first served.")


def check_enqueue(enqueue: Callable, max_examples: int = 10) -> Report:
    """Grade `enqueue(waiting: deque, request, preempted: bool) -> None` (it edits `waiting`)."""
    hooks = EngineHooks(enqueue=enqueue)

    def queue_alone():
        a, b, c = (SimpleNamespace(request_id=r, arrival_time=t)
                   for r, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
        waiting: deque = deque()
        for r in (a, b, c):
            enqueue(waiting, r, False)
        if [r.request_id for r in waiting] != ["a", "b", "c"]:
            raise ExerciseFailure(f"requests a, b, c arrived in that order and the queue became "
                                  f"{[r.request_id for r in waiting]}: new requests join the tail, "
                                  f"and the head (waiting[0]) is admitted next.")
        waiting.popleft()  # a is admitted and runs...
        enqueue(waiting, a, True)  # ...until it is preempted
        if [r.request_id for r in waiting] != ["a", "b", "c"]:
            raise ExerciseFailure(f"request a was admitted, then preempted, and the queue became "
                                  f"{[r.request_id for r in waiting]}: a preempted request is "
                                  f"older than everyone waiting, so it goes back to the head, or "
                                  f"later arrivals overtake it.")

    def engine_property():
        for_all_workloads(hooks, lambda w: run_workload(hooks, w, ArrivalOrder(w)), max_examples)

    return run_checks("ch01 enqueue (FCFS)", [
        ("new requests join the tail and preempted ones go back to the head", queue_alone),
        ("inside the real engine, on random workloads, nobody is overtaken and everyone finishes",
         engine_property)])
