"""A tensor-parallel worker process (ranks 1..N-1): its shard of the model, then a step per message.

Every rank runs the same `ModelRunner.execute` on the same SchedulerOutput and samples the same
tokens from the same all-gathered logits with the same seeds, so its per-sequence state stays equal
to rank 0's without being sent. Only rank 0's RunnerOutput is used.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.distributed.parallel import connect
from minivllm.runner.model_runner import ModelRunner
from minivllm.spec_decode import make_proposer


@dataclass(frozen=True)
class RankStateQuery:
    """Sent instead of a step: every worker reports `rank_state` on its pipe (tests, chapter 13)."""


def rank_state(runner) -> dict:
    """What must agree across ranks: each sequence's tokens and block table, the block count; and a
    sum per KV block of this rank's cache (equal across ranks only where they hold the same,
    replicated, KV heads)."""
    cache = runner.kv_cache.movedim(2, 0).flatten(1)  # [blocks, everything else]
    return {"sequences": {rid: (list(s.token_ids), list(s.block_table))
                          for rid, s in runner.sequences.items()},
            "num_blocks": runner.num_blocks, "kv_block_sums": cache.double().sum(dim=1).tolist()}


def worker_main(config: EngineConfig, rank: int, size: int, host: str, port: int, conn,
                timeout_s: float) -> None:
    """Entry point of a spawned worker. Reports ("joined"), ("ready", num_blocks) or ("error",
    traceback) on `conn`; returns when rank 0 broadcasts None (shutdown), exits with 1 on errors."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    try:
        store = dist.TCPStore(host, port, size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        conn.send(("joined", None))
        serve_steps(config, rank, size, store, timeout_s, conn.send)
    except BaseException:  # noqa: BLE001 - whatever it was, rank 0 must hear it
        report_failure(conn)


def report_failure(conn) -> None:
    """Inside a child's `except`: send ("error", traceback) to the parent, then exit with 1."""
    with contextlib.suppress(OSError):  # the parent may be gone too
        conn.send(("error", traceback.format_exc()))
    sys.exit(1)


def serve_steps(config: EngineConfig, rank: int, size: int, store: dist.Store, timeout_s: float,
                report=lambda message: None, device_index: int | None = None) -> None:
    """Join the groups, build this rank's ModelRunner, then execute each step rank 0 broadcasts
    until None."""
    if config.device.startswith("cuda"):
        index = rank if device_index is None else device_index  # torchrun: LOCAL_RANK
        config = replace(config, device=f"cuda:{index}")
        torch.cuda.set_device(index)
    tp = connect(rank, size, store, torch.device(config.device), timeout_s)
    runner = ModelRunner(config, tp=tp)
    runner.proposer = make_proposer(config, runner.num_blocks, config.model_config.vocab_size)
    report(("ready", runner.num_blocks))
    while (sched := tp.broadcast_object()) is not None:
        if isinstance(sched, RankStateQuery):
            report(("state", rank_state(runner)))
        else:
            runner.execute(sched)
