"""The tiled CPU linear kernel (minivllm/quantization/cpu_unquantized.py) against oneDNN's packed linear, per row count.

Every linear weight of bench/cpu_peer.py's `135m` Llama shape (30 layers of q/k/v, o, gate/up and down, plus the
tied 49152-row LM head: 134.5M weights), each multiplied by M rows of x, both layouts held, the two paths
alternating over rounds; the best round of each. GB/s is weight bytes over time: at M = 1 the matmuls are a
stream of the weights, so this is how close each gets to the machine's read bandwidth (bench/roofline.py).

    PYTHONPATH=. python bench/cpu_small_linear.py [--dtypes bfloat16,float32] [--rows 1,2,4,8,16] [--threads N]
        [--cpu-time]

`--cpu-time` times with this process's CPU time (use with `--threads 1` on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from minivllm.platforms.cpu import extension_built, tiled_applies
from minivllm.quantization.cpu_unquantized import pack_tiles, packed_linear, reorder_weight, tiled_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"threads {torch.get_num_threads()}, clock {'CPU' if args.cpu_time else 'wall'}, "
          f"load1 {os.getloadavg()[0]:.2f}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        if not (tiled_applies(dtype) and extension_built()):
            print(f"{dtype}: the small-batch kernel does not apply on this CPU")
            continue
        weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        onednn = [reorder_weight(w) for w in weights]
        small = [pack_tiles(w) for w in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}

            def run_onednn(weights=weights, onednn=onednn, xs=xs) -> None:
                for w, p in zip(weights, onednn):
                    packed_linear(xs[w.shape[1]], p, None)

            def run_small(weights=weights, small=small, xs=xs) -> None:
                for w, p in zip(weights, small):
                    tiled_linear(xs[w.shape[1]], p, None, w.shape[0])

            best = {"oneDNN": float("inf"), "small": float("inf")}
            for rnd in range(args.rounds):
                order = [("oneDNN", run_onednn), ("small", run_small)]
                for name, fn in order if rnd % 2 == 0 else order[::-1]:
                    fn()
                    start = clock()
                    for _ in range(5):
                        fn()
                    best[name] = min(best[name], (clock() - start) / 5)
            a, b = best["oneDNN"], best["small"]
            name = str(dtype).removeprefix("torch.")
            print(f"{name:9s} M={rows:<3d} oneDNN {a * 1e3:7.2f} ms ({nbytes / a / 1e9:5.1f} GB/s)   "
                  f"small {b * 1e3:7.2f} ms ({nbytes / b / 1e9:5.1f} GB/s)   small is {a / b:.2f}x   "
                  f"load1 {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
