"""Tensor parallelism on CPU: tp=1 versus tp=2, and what the step channel costs.

1. The same greedy workload through LLM(tensor_parallel_size=1) and (=2), float32: output tok/s and mean
   step time. On a CPU both ranks share one machine's cores and memory bandwidth, and every layer waits on two
   gloo all-reduces, so tp=2 is not expected to be faster here: the point is to measure what it costs.
2. The step channel: the real SchedulerOutputs of that run, sent rank 0 -> rank 1 and acknowledged, through
   (a) the gloo process group (pickle, broadcast length, broadcast bytes: what the engine does) and (b) a
   multiprocessing Pipe; plus (c) an empty gloo all-reduce, the floor of any collective round trip.

    python bench/tp_throughput.py [--model PATH] [--requests 16]

The machine's load average is printed before and after: on a shared machine it moves every figure.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_workload  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import DEFAULT_MODEL  # noqa: E402
from minivllm.distributed.parallel import connect  # noqa: E402


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def run_engine(model: str, tp: int, work: list, record: list | None) -> tuple[float, float, int]:
    """(output tok/s, mean step ms, steps) for the workload on `tp` ranks (after a short warm-up)."""
    with LLM(model, tensor_parallel_size=tp, dtype="float32", trace_steps=0) as llm:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        prompts = [{"prompt_token_ids": p} for p, _ in work]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)
        if record is not None:
            llm.engine.add_step_observer(lambda engine, rec: record.append(rec.scheduler_output))
        steps, start = llm.engine.stats()["num_steps"], time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        steps = llm.engine.stats()["num_steps"] - steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, 1000 * seconds / steps, steps


def echo(port: int, conn) -> None:
    """Rank 1 of the channel benchmark: acknowledge every message, over gloo and then over the pipe."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    tp = connect(1, 2, store, torch.device("cpu"), 60)
    ack = torch.zeros(1)
    while tp.broadcast_object() is not None:
        tp.cpu_group.allreduce([ack]).wait()
    while conn.recv() is not None:
        conn.send(None)
    while conn.recv() is not None:  # rank 0 says "go", then both meet in an all-reduce
        tp.cpu_group.allreduce([ack]).wait()


def channel(messages: list) -> dict[str, float]:
    """Median round trip (microseconds) of one step's message through each channel."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=echo, args=(store.port, child), daemon=True)
    proc.start()
    tp = connect(0, 2, store, torch.device("cpu"), 60)
    ack, times = torch.zeros(1), {"gloo broadcast": [], "pipe": [], "gloo all-reduce (empty)": []}
    for message in messages:
        start = time.perf_counter()
        tp.broadcast_object(message)
        tp.cpu_group.allreduce([ack]).wait()
        times["gloo broadcast"].append(time.perf_counter() - start)
    tp.broadcast_object(None)
    for message in messages:
        start = time.perf_counter()
        parent.send(message)
        parent.recv()
        times["pipe"].append(time.perf_counter() - start)
    parent.send(None)
    for _ in messages:
        parent.send(True)
        start = time.perf_counter()
        tp.cpu_group.allreduce([ack]).wait()
        times["gloo all-reduce (empty)"].append(time.perf_counter() - start)
    parent.send(None)
    proc.join(timeout=10)
    if proc.exitcode is None:
        proc.kill()
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=64)
    args = ap.parse_args()
    print(f"before: {load()}; torch {torch.__version__}")
    vocab = LLM(args.model, num_kv_blocks=8, trace_steps=0).engine.config.model_config.vocab_size
    work = make_workload(args.requests, (args.min_len, args.max_len), (args.min_len, args.max_len), vocab)
    print(f"model: {args.model} (float32); {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
          f"{sum(n for _, n in work)} output tokens")
    messages: list = []
    for tp in (1, 2):
        tok_s, step_ms, steps = run_engine(args.model, tp, work, messages if tp == 2 else None)
        print(f"tp={tp}: {tok_s:8.1f} output tok/s, {step_ms:6.1f} ms/step ({steps} steps)")
    sizes = [len(pickle.dumps(m)) for m in messages]
    print(f"step channel, {len(messages)} real SchedulerOutputs ({statistics.median(sizes):.0f} bytes pickled, "
          f"median), round trip rank 0 -> rank 1 -> rank 0, median:")
    for name, us in channel(messages).items():
        print(f"  {name:26s} {us:8.0f} us")
    print(f"after: {load()}")


if __name__ == "__main__":
    main()
