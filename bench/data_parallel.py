"""Data parallelism on a CPU: memory per process (PSS, USS) and throughput, one engine vs two.

Two questions. Memory: with `data_parallel_size=2` both engines map one copy of the weights
(minivllm/model/weight_cache.py), so the second engine should add its interpreter, its KV cache and
its activations, but next to nothing for the weights; the target is that it adds at most 10% of the
weight bytes for them. Throughput: two engines with one thread each vs one engine with two threads,
on this machine's cores.

Each run is a fresh subprocess (`--child`) that starts an LLM on a random 135M-shaped checkpoint
(bench/cpu_peer.py's `build_checkpoint("135m")`, float32 unless --dtype), runs one workload
(`--requests` requests, prompt lengths uniform in [16, 128], `--max-tokens` tokens each, greedy,
ignore_eos), then reads /proc/PID/smaps_rollup (PSS; USS = Private_Clean + Private_Dirty) of every
engine process, and /proc/PID/smaps for the weight file's own mapping (how much of it each process
maps, shares, and holds privately). The weight cache is a fresh temporary directory: the first DP=2
run writes it (its start time says so), later ones map it. DP=1 and DP=2 runs alternate, `--rounds`
times; the load average is printed before and after each.

    PYTHONPATH=. python bench/data_parallel.py [--rounds 2] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MIB = 2**20


def rollup(pid: int) -> dict:
    """PSS, USS and RSS of one process, bytes (smaps_rollup)."""
    kb = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        kb[key] = int(value.split()[0])
    return {"pss": kb["Pss"] * 1024, "uss": (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024,
            "rss": kb["Rss"] * 1024}


def file_mapping(pid: int, suffix: str) -> dict:
    """How much of the files whose names end in `suffix` this process maps: rss, pss, private."""
    out, inside = {"rss": 0, "pss": 0, "private": 0}, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[-1].endswith(suffix)
        elif inside and head[0] in ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:"):
            key = {"Rss:": "rss", "Pss:": "pss"}.get(head[0], "private")
            out[key] += int(head[1]) * 1024
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, data_parallel_size=args.dp,
              num_kv_blocks=args.kv_blocks, max_model_len=512)
    started = time.perf_counter() - start
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(16, 128))]
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    model = llm.engine.runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    pids = [os.getpid()] + ([p.pid for p in llm._data_parallel.processes.procs]
                            if llm._data_parallel else [])
    procs = [{"pid": pid, **rollup(pid), "weights_file": file_mapping(pid, ".weights")}
             for pid in pids]
    print(json.dumps({"dp": args.dp, "start_s": started, "seconds": seconds, "tokens": tokens,
                      "tok_s": tokens / seconds, "weight_bytes": weight_bytes, "procs": procs,
                      "threads": torch.get_num_threads()}))
    llm.shutdown()


def run(dp: int, model: Path, cache: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIVLLM_WEIGHT_CACHE_DIR": str(cache),
           "HF_HUB_OFFLINE": "1"}
    before = os.getloadavg()
    out = subprocess.run([sys.executable, __file__, "--child", "--dp", str(dp), "--model",
                          str(model), "--dtype", args.dtype, "--requests", str(args.requests),
                          "--max-tokens", str(args.max_tokens), "--kv-blocks",
                          str(args.kv_blocks)], env=env, capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise SystemExit(f"DP={dp} run failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["load"] = (before, os.getloadavg())
    return result


def show(r: dict) -> None:
    load = " / ".join(f"{a[0]:.2f}" for a in r["load"])
    print(f"DP={r['dp']}: start {r['start_s']:.1f} s, {r['tok_s']:.0f} tok/s ({r['tokens']} tokens "
          f"in {r['seconds']:.1f} s), load average (1 min) before / after {load}")
    for i, p in enumerate(r["procs"]):
        w = p["weights_file"]
        print(f"  engine {i} pid {p['pid']}: PSS {p['pss'] / MIB:7.1f} MiB, USS {p['uss'] / MIB:7.1f}"
              f" MiB, RSS {p['rss'] / MIB:7.1f} MiB; weight file mapped {w['rss'] / MIB:6.1f} MiB, "
              f"PSS {w['pss'] / MIB:6.1f}, private {w['private'] / MIB:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-blocks", type=int, default=128, help="per engine")
    args = parser.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(BENCH))
    from cpu_peer import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint("135m", Path(tmp))
        cache = Path(tmp) / "weight-cache"
        print(f"135m-shaped random checkpoint, dtype {args.dtype}, {os.cpu_count()} CPUs, "
              f"{args.requests} requests x {args.max_tokens} tokens, {args.kv_blocks} KV blocks "
              f"per engine")
        results: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for dp in (1, 2):
                results[dp].append(run(dp, model, cache, args))
                show(results[dp][-1])
    one, two = results[1][-1], results[2][-1]
    weights = one["weight_bytes"]
    pss1, pss2 = (sum(p["pss"] for p in r["procs"]) for r in (one, two))
    second = two["procs"][1]
    second_weights = second["weights_file"]["pss"] + second["weights_file"]["private"]
    print(f"\nweights {weights / MIB:.1f} MiB; total PSS DP=1 {pss1 / MIB:.1f} MiB, DP=2 "
          f"{pss2 / MIB:.1f} MiB: the second engine adds {(pss2 - pss1) / MIB:.1f} MiB in all "
          f"({(pss2 - pss1) / weights:.0%} of the weight bytes)")
    extra = sum(p["weights_file"]["pss"] for p in two["procs"]) - weights
    print(f"weights under DP=2: the file's PSS over both engines {(extra + weights) / MIB:.1f} MiB "
          f"(one copy: {weights / MIB:.1f}); engine 1 holds {second['weights_file']['private'] / MIB:.1f}"
          f" MiB of it privately; the weight bytes DP=2 adds beyond one copy: {extra / MIB:+.1f} MiB "
          f"({extra / weights:+.1%}; target <= 10%); engine 1's share of the file "
          f"{second_weights / MIB:.1f} MiB")
    tok1 = statistics.median(r["tok_s"] for r in results[1])
    tok2 = statistics.median(r["tok_s"] for r in results[2])
    print(f"throughput (median of {args.rounds}): DP=1 {tok1:.0f} tok/s, DP=2 {tok2:.0f} tok/s "
          f"({tok2 / tok1:.2f}x)")


if __name__ == "__main__":
    main()
