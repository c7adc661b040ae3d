"""Compiled layers (model/compiled.py) against the plain ones, in one process, alternating rounds of decode steps.

One engine, built with MINIVLLM_CPU_COMPILE=1; each round runs `batch` fresh 128-token requests with the compiled
pieces installed, then with them removed (the order alternates per round), so a busy spell on a shared machine
hits both. `--cpu-time` times each step by this process's CPU time instead of the wall clock: on a machine
shared with other jobs that measures the work done rather than the wait for a core (use with `--threads 1`).

    PYTHONPATH=. python bench/cpu_compile_ab.py --model PATH [--dtype bfloat16] [--batches 1,64] [--rounds 4]
        [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ["MINIVLLM_CPU_COMPILE"] = "1"

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.model.compiled import PIECES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="fixed torch threads (default: the thread sizer)")
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, trace_steps=0, cpu_threads=args.threads)
    engine, rng = llm.engine, random.Random(0)
    layers = engine.runner.compiled.layers
    pieces = {(i, name): layer.__dict__[name] for i, layer in enumerate(layers) for name in PIECES}
    clock = time.process_time if args.cpu_time else time.perf_counter

    def steps(batch: int, mode: str, n: int) -> list[float]:
        for (i, name), piece in pieces.items():
            if mode == "compiled":
                layers[i].__dict__[name] = piece
            else:
                layers[i].__dict__.pop(name, None)
        for _ in range(batch):
            engine.add_request(f"{mode}-{time.monotonic_ns()}", {"prompt_token_ids": [rng.randrange(10, 1000)
                                                                                     for _ in range(128)]},
                               SamplingParams(temperature=0, max_tokens=n + 3, ignore_eos=True))
        for _ in range(3):  # prefill and the first decode steps
            engine.step()
        times = []
        while engine.has_unfinished_requests():
            start = clock()
            engine.step()
            times.append(clock() - start)
        return times[:-1]

    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:  # compile every shape class first, and report what that cost
        start = time.perf_counter()
        steps(batch, "compiled", 3)
        print(f"batch {batch}: first compiled steps (compiling) {time.perf_counter() - start:.1f} s", flush=True)
    results: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for batch in batches:
            for mode in ("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager"):
                results.setdefault((batch, mode), []).extend(steps(batch, mode, 40 if batch == 1 else 20))
        print(f"round {rnd}: load1 {os.getloadavg()[0]:.2f}", flush=True)
    unit = "CPU ms" if args.cpu_time else "ms"
    for batch in batches:
        eager, compiled = (statistics.median(results[(batch, m)]) * 1e3 for m in ("eager", "compiled"))
        print(f"{args.dtype} batch {batch}: eager {eager:.1f} {unit}, compiled {compiled:.1f} {unit} per step, "
              f"speed-up {eager / compiled:.3f}x")


if __name__ == "__main__":
    main()
