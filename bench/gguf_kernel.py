"""GGUF's block kernel (minivllm/quantization/cpu_gguf.cpp) at decode batches, against the memory floor.

A "step" is the 120 linears of bench/cpu_peer.py's `135m` Llama shape (30 layers of q/k/v 960x576, o 576x576,
gate/up 3072x576 and down 576x1536, no LM head), each layer its own copy of the blocks so that they stream from
memory rather than cache, multiplied by M rows of x straight from the blocks (`gguf_linear`). The floor is the
step's block bytes over the read bandwidth measured in the same run (the best of 5 sums of a 512 MiB tensor): a
decode step cannot read its weights faster, so ms / floor says how far the kernel is from memory bound.

    PYTHONPATH=. python bench/gguf_kernel.py [--types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q6_K,Q4_0-int8,...]
        [--rows 1,4,8] [--rounds 5] [--threads N] [--cpu-time]

On a shared machine, two threads wait for each other whenever another process holds a core (each of the 120
parallel regions can then lose a scheduler tick): `--threads 1 --cpu-time` times this process's CPU time on one
core, against a floor measured on one core too.

Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks are random normal weights quantized by the `gguf` package; the package cannot quantize
Q4_K/Q6_K, so those are random bytes with small fp16 scales (every bit pattern is a valid code), and their rows
must hold whole super-blocks of 256 weights: K = 576 is rounded up to 768 for them (llama.cpp itself stores such
tensors in another type).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from minivllm.platforms.cpu import extension_built
from minivllm.quantization import cpu_gguf

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down (N x K)
LAYERS = 30
TYPES = {"Q4_0": cpu_gguf.Q4_0, "Q4_1": cpu_gguf.Q4_1, "Q5_0": cpu_gguf.Q5_0, "Q5_1": cpu_gguf.Q5_1,
         "Q8_0": cpu_gguf.Q8_0, "Q4_K": cpu_gguf.Q4_K, "Q6_K": cpu_gguf.Q6_K}
# every type with x quantized to int8 per call (llama.cpp's arithmetic; cpu_gguf.py), its rows packed for it
INT8 = {f"{name}-int8": ggml_type for name, ggml_type in TYPES.items()}


def read_bandwidth(clock) -> float:
    """Bytes per second a sum streams from memory: the best of 5 sums of 512 MiB of fp32."""
    ones = torch.ones(512 * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = clock()
        ones.sum()
        best = min(best, clock() - start)
    return ones.numel() * 4 / best


def blocks_of(name: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """One [n, k] weight of GGML type `name` as uint8 blocks [n, bytes per row]."""
    import gguf

    kind = gguf.GGMLQuantizationType[name]
    weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
    if name in ("Q4_K", "Q6_K"):
        blocks = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
        scales = rng.uniform(0.001, 0.02, (n, k // weights, 2)).astype(np.float16).view(np.uint8)
        if name == "Q4_K":  # d, dmin lead the block
            blocks[..., 0:4] = scales.reshape(n, k // weights, 4)
        else:  # Q6_K: d ends it
            blocks[..., 208:210] = scales[..., :2]
        return torch.from_numpy(blocks.reshape(n, -1))
    return torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=",".join([*TYPES, *INT8]))
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not extension_built():
        raise SystemExit("the C++ kernels are not built on this machine: nothing to time")
    bandwidth = read_bandwidth(clock)
    print(f"threads {torch.get_num_threads()}, clock {'CPU' if args.cpu_time else 'wall'}, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s, load1 {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        ggml_type = TYPES.get(name) or INT8[name]
        per_block = cpu_gguf.BLOCKS[ggml_type][0]  # Q4_K/Q6_K rows hold whole super-blocks of 256: 576 -> 768
        shapes = [(n, k, blocks_of(name.removesuffix("-int8"), n, k, rng))
                  for n, k in ((n, -(-k // per_block) * per_block) for n, k in SHAPES)]
        if name in INT8:
            shapes = [(n, k, torch.ops.minivllm_cpu.gguf_pack(b, ggml_type)) for n, k, b in shapes]
            ggml_type |= cpu_gguf.PACKED
        layers = [(n, k, blocks.clone()) for _ in range(LAYERS) for n, k, blocks in shapes]  # own copies: no cache
        floor = sum(blocks.numel() for _, _, blocks in layers) / bandwidth
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {k for _, k, _ in shapes}}

            def step(layers=layers, xs=xs, ggml_type=ggml_type) -> None:
                for n, k, blocks in layers:
                    cpu_gguf.gguf_linear(xs[k], blocks, ggml_type, n)

            step()  # warm: the first call may build the extension or page in the blocks
            best = float("inf")
            for _ in range(args.rounds):
                start = clock()
                step()
                best = min(best, clock() - start)
            print(f"{name} M={rows}  {best * 1e3:6.2f} ms/step  floor {floor * 1e3:5.2f} ms  "
                  f"ratio {best / floor:4.2f}  load1 {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
