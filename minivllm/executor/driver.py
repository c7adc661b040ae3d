"""Rank 0's ModelRunner under tensor parallelism: the runner on its shard, plus the step channel.

Each step it broadcasts the SchedulerOutput (pickled) over the gloo group, then executes it itself;
the workers do the same and meet it in the collectives inside the model. A process group rather
than a pipe because it also crosses machines (torchrun), at about the same cost
(bench/tp_throughput.py). If anything fails mid-step, every worker is stopped: the engine does not
limp on with ranks that disagree.
"""

from __future__ import annotations

import contextlib

from minivllm.config import EngineConfig
from minivllm.core.step_io import RunnerOutput, SchedulerOutput
from minivllm.distributed.parallel import CollectiveTraffic
from minivllm.executor.worker import RankStateQuery, rank_state
from minivllm.executor.workers import Workers
from minivllm.runner.model_runner import ModelRunner


class TensorParallelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, draft_reserve: tuple[int, int] = (0, 0)) -> None:
        self.workers = Workers(config)
        with self._together():  # one rank's start-up error fails the whole LLM(...) with it
            super().__init__(config, draft_reserve, self.workers.tp)
            self.workers.expect("ready")

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        with self._together():
            self.workers.broadcast(sched)
            return super().execute(sched)

    @contextlib.contextmanager
    def _together(self):
        """Any failure (a worker died mid-step and its collective failed; Ctrl-C) stops every
        worker, and raises the workers' own error where they have one."""
        try:
            yield
        except BaseException as e:
            error = self.workers.fail()
            if error is not None:
                raise error from e
            raise

    @property
    def traffic(self) -> CollectiveTraffic:
        """What rank 0's collectives carried so far (same on every rank); `.reset()` zeroes it."""
        return self.workers.tp.traffic

    def rank_states(self) -> list[dict]:
        """Every rank's `rank_state`, rank 0 first, between steps (spawned workers only)."""
        self.workers.broadcast(RankStateQuery())
        return [rank_state(self), *self.workers.expect("state")]

    def shutdown(self) -> None:
        self.workers.shutdown()
