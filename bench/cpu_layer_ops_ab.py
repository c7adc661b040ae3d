"""The CPU's fused layer ops (model/cpu_layer_ops.py) against the readable torch ops, in one process.

Two engines on the same checkpoint, one built with MINIVLLM_CPU_LAYER_OPS=0; each round gives both `batch` fresh
128-token requests, then alternates their decode steps (which one goes first alternates too), so a busy spell on
a shared machine hits both. Prints each one's median step, and the aten ops a step dispatches (torch.profiler,
nested ops included) and the fused ops among them. `--cpu-time` times steps by this process's CPU time instead of
the wall clock: on a machine shared with other jobs it measures the work rather than the wait for a core (use it
with `--threads 1`).

    PYTHONPATH=. python bench/cpu_layer_ops_ab.py --model PATH [--dtype bfloat16] [--batches 1,64] [--rounds 3]
        [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams


def add_requests(engine, batch: int, max_tokens: int, rng: random.Random) -> None:
    for _ in range(batch):
        prompt = [rng.randrange(10, 1000) for _ in range(128)]
        engine.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for _ in range(3):  # the prefill and the first decodes
        engine.step()


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def op_counts(engine, batch: int, rng: random.Random, steps: int = 5) -> tuple[float, float]:
    """(aten ops, minivllm_cpu ops) per decode step."""
    add_requests(engine, batch, steps + 5, rng)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    drain(engine)
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    fused = sum(e.count for e in events if e.key.startswith("minivllm_cpu::"))
    return aten / steps, fused / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="fixed torch threads (default: the thread sizer)")
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()

    engines = {}
    for name, setting in (("readable", "0"), ("fused", "1")):
        os.environ["MINIVLLM_CPU_LAYER_OPS"] = setting  # read when the engine's backend is built
        engines[name] = LLM(args.model, dtype=args.dtype, trace_steps=0, cpu_threads=args.threads).engine
    os.environ.pop("MINIVLLM_CPU_LAYER_OPS")
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = random.Random(0)
    for batch in (int(b) for b in args.batches.split(",")):
        steps = 40 if batch == 1 else 12
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for engine in engines.values():
                add_requests(engine, batch, steps + 4, rng)
            for i in range(steps):
                for name in (("readable", "fused") if i % 2 == 0 else ("fused", "readable")):
                    start = clock()
                    engines[name].step()
                    times[name].append(clock() - start)
            for engine in engines.values():
                drain(engine)
        load = os.getloadavg()[0]
        print(f"{args.dtype} batch {batch}, threads {args.threads or 'sizer'}, "
              f"{'CPU time' if args.cpu_time else 'wall'}, load1 {load:.2f}")
        for name, engine in engines.items():
            aten, fused = op_counts(engine, batch, rng)
            print(f"  {name:8}: median {statistics.median(times[name]) * 1e3:7.2f} ms/step over {len(times[name])} "
                  f"steps; {aten:.0f} aten ops, {fused:.0f} fused ops a step")
        print(f"  speedup {statistics.median(times['readable']) / statistics.median(times['fused']):.2f}x")


if __name__ == "__main__":
    main()
