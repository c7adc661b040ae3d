"""Offline throughput on CPU: minivllm versus transformers `generate`, same model, same workload, one run.

Workload (issue 2): 64 requests, prompt and output lengths uniform in [16, 256], ignore_eos, seed 0
(`--seeds 0,1,2`: one workload per seed, each measured on both engines, for issue 37's "any workload";
`--prompt-lens 256,256 --output-lens 16,16` and the reverse: the two ends of that range).
Greedy decoding on both sides, so the two do identical arithmetic per token.

    python bench/cpu_throughput.py [--model PATH] [--requests 64] [--dtype float32|bfloat16] [--seeds 0]

Both engines run in `--dtype` (float32 by default, where their arithmetic is the same).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_workload, transformers_throughput  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import DEFAULT_MODEL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--prompt-lens", help="lo,hi: the prompts' range, instead of --min-len/--max-len")
    ap.add_argument("--output-lens", help="lo,hi: the outputs' range, instead of --min-len/--max-len")
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seeds", default="0", help="comma-separated workload seeds, each run on both engines")
    args = ap.parse_args()
    both = (args.min_len, args.max_len)
    args.prompt_range = tuple(map(int, args.prompt_lens.split(","))) if args.prompt_lens else both
    args.output_range = tuple(map(int, args.output_lens.split(","))) if args.output_lens else both
    ratios = [run(args, int(seed)) for seed in args.seeds.split(",")]
    print("ratios per seed: " + ", ".join(f"{r:.2f}x" for r in ratios))


def run(args, seed: int) -> float:
    """One workload (seed `seed`) through minivllm, then transformers at each batch size: the ratio."""
    llm = LLM(args.model, dtype=args.dtype, trace_steps=0)
    vocab = llm.engine.config.model_config.vocab_size
    work = make_workload(args.requests, args.prompt_range, args.output_range, vocab, seed)
    total_out = sum(n for _, n in work)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"model: {args.model} ({args.dtype}); seed {seed}, {len(work)} requests, "
          f"{sum(len(p) for p, _ in work)} prompt tokens, {total_out} output tokens")

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    # warm-up on 16 requests of another seed: torch's CPU kernels and allocator settle on the real shapes,
    # and no prompt of the timed run is already in the prefix cache
    warm = make_workload(16, args.prompt_range, args.output_range, vocab, seed + 10_000)
    llm.generate([{"prompt_token_ids": p} for p, _ in warm],
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in warm], use_tqdm=False)
    steps_before, start = llm.engine.stats()["num_steps"], time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    ours_s = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total_out
    ours = total_out / ours_s
    steps = llm.engine.stats()["num_steps"] - steps_before
    print(f"minivllm:     {ours:8.1f} output tok/s ({ours_s:.1f} s, {steps} steps)")
    del llm

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    transformers_throughput(hf, warm, 16)  # the same warm-up
    best = (0.0, 0, 0.0)
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        tps, secs = transformers_throughput(hf, work, bs)
        print(f"transformers: {tps:8.1f} output tok/s ({secs:.1f} s, batch size {bs})")
        best = max(best, (tps, bs, secs))
    print(f"ratio minivllm / best transformers (batch {best[1]}): {ours / best[0]:.2f}x, load "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return ours / best[0]


if __name__ == "__main__":
    main()
