"""Roofline of this CPU for the 135M shape: how close minivllm's decode steps come to the machine's limits.

Measured here, with torch's threads as the engine would use them:
- memory bandwidth: a large tensor copy (bytes read + bytes written per second, best of `--repeats`);
- matmul peak: a large square GEMM in bf16 and fp32 (GFLOP/s, best of `--repeats`);
- minivllm decode steps on the 135M shape (bench/cpu_peer.py's random checkpoint), 128-token contexts:
  batch 1 reads every weight once per token, so weight bytes / step time against the bandwidth is how close it
  comes to the memory floor; batch 64 does 2 * params * 64 matmul flops a step, against the GEMM peak.

    PYTHONPATH=. python bench/roofline.py [--dtypes bfloat16,float32] [--repeats 5] [--size-mib 512]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import SHAPES, build_checkpoint, machine_info, machine_kind  # noqa: E402


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, oneDNN primitive creation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(size_mib: int, repeats: int) -> float:
    """GB/s of a large copy, read and write both counted (what a weight stream through the caches costs)."""
    src = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def gemm_peak(dtype: torch.dtype, n: int, repeats: int) -> float:
    """GFLOP/s of an n x n x n matmul."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def matmul_params(shape: str) -> int:
    """Weights every token multiplies by: each layer's q/k/v/o and MLP, and the LM head (tied to the embedding)."""
    s, vocab = SHAPES[shape], 49152
    hidden, inter, head_dim = s["hidden_size"], s["intermediate_size"], s["hidden_size"] // s["num_attention_heads"]
    attn = hidden * head_dim * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    return s["num_hidden_layers"] * (attn + 3 * hidden * inter) + vocab * hidden


def decode_step_ms(path: Path, dtype: str, batch: int, steps: int = 20) -> float:
    """Median decode step of `batch` requests at 128-token contexts (after their prefill and 3 warm-up steps)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, trace_steps=0)
    engine, rng = llm.engine, random.Random(0)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(10, 49152) for _ in range(128)]},
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # prefill (one step for up to 2048 tokens, two for 64 x 128), then warm decode steps
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=512, help="copy size: well above the last-level cache")
    ap.add_argument("--gemm-n", type=int, default=2048)
    ap.add_argument("--shape", default="135m", choices=sorted(SHAPES))
    args = ap.parse_args()

    info = machine_info()
    print(f"machine: {machine_kind(info)}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    bandwidth = copy_bandwidth(args.size_mib, args.repeats)
    print(f"memory bandwidth (copy of {args.size_mib} MiB, read + write): {bandwidth:.1f} GB/s")
    params = matmul_params(args.shape)
    with tempfile.TemporaryDirectory(prefix="roofline_") as tmp:
        path = build_checkpoint(args.shape, Path(tmp))
        print("| dtype | GEMM peak GFLOP/s | batch-1 step ms | floor ms (weights / bandwidth) | step / floor "
              "| batch-64 step ms | batch-64 matmul GFLOP/s | % of peak | load1 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            peak = gemm_peak(dtype, args.gemm_n, args.repeats)
            b1, b64 = decode_step_ms(path, name, 1), decode_step_ms(path, name, 64)
            floor_ms = params * dtype.itemsize / (bandwidth * 1e9) * 1e3
            achieved = 2 * params * 64 / (b64 / 1e3) / 1e9
            print(f"| {name} | {peak:.0f} | {b1:.1f} | {floor_ms:.1f} | {b1 / floor_ms:.2f}x | {b64:.1f} "
                  f"| {achieved:.0f} | {100 * achieved / peak:.0f}% | {os.getloadavg()[0]:.2f} |", flush=True)
    print(f"({args.shape}: {params / 1e6:.1f}M matmul weights per token, {params * 2 / 1e6:.0f} MB in bf16; "
          "batch-64 flops count matmuls only, the step's whole time in the denominator)")


if __name__ == "__main__":
    main()
