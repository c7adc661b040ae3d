"""CPU attention, kernel versus reference (issue 29 item 2): the torch backend's compiled kernel that reads the paged
cache in place (minivllm/attention/cpu_attention.py) against the reference that gathers each request's blocks.

Three parts, on bench/cpu_peer.py's randomly initialised `135m` Llama shape (9 heads / 3 KV heads, head_dim 64):
  engine:  cpu_peer's minivllm child (batch-64 throughput on its workload, batch-1 ms/token), once with
           MINIVLLM_CPU_ATTENTION=kernel and once =reference, alternating within each round, each in its own process;
  micro:   the attention call alone on one decode batch (64 requests, contexts uniform in [32, 500]), alternating;
  profile: torch.profiler over decode steps at batch 64 and batch 1, the top ops by self CPU time.
Load averages are printed with every figure: on a shared machine only ratios taken in the same run mean anything.

    PYTHONPATH=. python bench/cpu_attention.py [--parts engine,micro,profile] [--dtypes float32,bfloat16]
        [--requests 64] [--rounds 2] [--attention kernel,reference]
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
sys.path.insert(0, str(BENCH))
from cpu_peer import build_checkpoint, child_minivllm  # noqa: E402


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


# ---- engine: one process per (dtype, attention), alternating -----------------------------------------------
def run_engine_child(spec: dict, attention: str) -> dict:
    env = dict(os.environ, MINIVLLM_CPU_ATTENTION=attention,
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    before = load()
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]), load=f"{before}->{load()}")


def engine_part(path: Path, dtypes: list[str], modes: list[str], requests: int, rounds: int) -> None:
    base = dict(path=str(path), requests=requests, lens=[16, 256], b1_prompt=128, b1_output=128,
                warmup=min(8, requests))
    for dtype in dtypes:
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for rnd in range(rounds):
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                res = run_engine_child(dict(base, dtype=dtype), mode)
                results[mode].append(res)
                print(f"  {dtype} round {rnd} {mode:9s} {res['tok_s']:7.1f} tok/s (batch {requests})  "
                      f"{res['ms_per_tok']:6.1f} ms/token (batch 1)  TTFT {res['ttft_ms']:6.1f} ms  "
                      f"load {res['load']}", flush=True)
        print(f"\n{dtype}, median of {rounds}: | attention | tok/s (batch {requests}) | ms/token (batch 1) |")
        for mode, rs in results.items():
            print(f"| {mode} | {statistics.median(r['tok_s'] for r in rs):.1f} "
                  f"| {statistics.median(r['ms_per_tok'] for r in rs):.1f} |")


# ---- micro: the attention call alone ------------------------------------------------------------------------
def micro_part(dtypes: list[str], repeats: int = 30) -> None:
    import torch

    from minivllm.attention import cpu_attention
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.attention.torch_backend import paged_decode_ref
    from minivllm.platforms.cpu import extension_built

    kernel = cpu_attention.paged_attention if extension_built() else None
    rng = random.Random(0)
    seq_lens = [rng.randint(32, 500) for _ in range(64)]
    block_size, heads, kv_heads, dim = 16, 9, 3, 64
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(0)).tolist()
    tables, used = torch.zeros(len(need), max(need), dtype=torch.int32), 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used : used + n])
        used += n
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        k_cache, v_cache = (torch.randn(sum(need), block_size, kv_heads, dim).to(dtype) for _ in range(2))
        q = torch.randn(len(need), heads, dim).to(dtype)

        def meta() -> AttentionMetadata:  # fresh: the reference's per-step plans are part of its cost
            return AttentionMetadata(torch.zeros(len(need), dtype=torch.long), tables, torch.tensor(
                seq_lens, dtype=torch.int32), torch.arange(len(need) + 1, dtype=torch.int32), 1, max(seq_lens),
                [1] * len(need), seq_lens)

        calls = {"reference": paged_decode_ref, "kernel": kernel}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():
            fn(q, k_cache, v_cache, meta(), 0.125)
        for _ in range(repeats):
            for name, fn in calls.items():
                step_meta = meta()
                start = time.perf_counter()
                fn(q, k_cache, v_cache, step_meta, 0.125)
                times[name].append((time.perf_counter() - start) * 1e3)
        print(f"  micro {dtype_name} decode batch 64, {torch.get_num_threads()} threads: " + ", ".join(
            f"{n} median {statistics.median(t):.2f} ms (min {min(t):.2f})" for n, t in times.items())
            + f"  load {load()}")


# ---- profile: decode steps under torch.profiler -------------------------------------------------------------
def profile_part(path: Path, dtype: str, batch: int, steps: int = 8, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    from minivllm import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, trace_steps=0)
    engine, rng = llm.engine, random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(10, 49152) for _ in range(rng.randint(16, 256))]
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    for _ in range(batch + 4):  # every prompt prefilled: only decodes from here
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    table = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in table)
    calls = sum(e.count for e in table if e.key.startswith("aten::"))
    layers = engine.config.model_config.num_layers
    mode = os.environ.get("MINIVLLM_CPU_ATTENTION", "kernel")
    print(f"\n  profile {dtype} batch {batch} attention={mode}: {step_ms:.1f} ms/step under the profiler, "
          f"{calls / steps / layers:.0f} aten calls per layer per step, load {load()}")
    for e in sorted(table, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.self_cpu_time_total / total * 100:5.1f}%  {e.count / steps:6.0f}/step  {e.key}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--profile-child", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="engine,micro,profile")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--attention", default="kernel,reference")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile-batches", default="64,1")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_minivllm(json.loads(args.child))), flush=True)
        return
    if args.profile_child:
        spec = json.loads(args.profile_child)
        profile_part(Path(spec["path"]), spec["dtype"], spec["batch"])
        return

    import torch

    from minivllm.platforms.cpu import extension_built

    start = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {load()}; kernel "
          f"{'ready' if extension_built() else 'UNAVAILABLE'} after {time.perf_counter() - start:.1f} s "
          f"(a build, or torch's extension cache)", flush=True)
    parts, dtypes, modes = args.parts.split(","), args.dtypes.split(","), args.attention.split(",")
    if "micro" in parts:
        micro_part(dtypes)
    with tempfile.TemporaryDirectory(prefix="cpu_attention_") as tmp:
        path = build_checkpoint("135m", Path(tmp))
        if "engine" in parts:
            engine_part(path, dtypes, modes, args.requests, args.rounds)
        if "profile" in parts:
            for dtype in dtypes:
                for batch in [int(b) for b in args.profile_batches.split(",")]:
                    for mode in modes:
                        env = dict(os.environ, MINIVLLM_CPU_ATTENTION=mode, PYTHONPATH=os.pathsep.join(
                            [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
                        spec = json.dumps(dict(path=str(path), dtype=dtype, batch=batch))
                        subprocess.run([sys.executable, __file__, "--profile-child", spec], env=env, check=True)


if __name__ == "__main__":
    main()
