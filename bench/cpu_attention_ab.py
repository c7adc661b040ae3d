"""CPU attention kernel, an older revision against the working tree's, in one process (alternating, many rounds).

The older kernel's source is taken from git (`--old`, a revision whose op has the pre-store signature: attention
only; this step's K/V then go through store_kv, as the backend did) and built under its own op namespace, so both
kernels load side by side. Shapes: bench/cpu_peer.py's `135m` (9 heads / 3 KV heads, head_dim 64, block size 16).

    decode64       64 decodes, contexts uniform in [128, 256]: the attention call alone
    decode1+store  one decode over 200 tokens, storing its K/V first (store_kv + old op vs the new op's store)
    prefill256     one 256-token prompt
    chunk64/256    a 64-token chunk after a 192-token prefix

`--sets 6` cycles six copies of every input (~60-120 MB, past this machine's 32 MB L3), as an engine's 30 layers do;
`--sets 1` reuses one, which stays in L3. 1 thread is timed by process time (a busy shared machine steals wall time),
2 threads by wall time (their min is then the figure to trust).

    PYTHONPATH=. python bench/cpu_attention_ab.py [--old 37389f3] [--threads 1] [--sets 6] [--rounds 41]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from minivllm.attention import cpu_attention
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import store_kv
from minivllm.platforms.cpu import extension_built

ROOT = Path(__file__).resolve().parent.parent
BLOCK, HEADS, KV_HEADS, DIM = 16, 9, 3, 64
_rng = random.Random(0)
CASES = {  # name: (query lengths, context lengths, store this step's K/V in the call)
    "decode64": ([1] * 64, [_rng.randint(128, 256) for _ in range(64)], False),
    "decode1+store": ([1], [200], True),
    "prefill256": ([256], [256], False),
    "chunk64/256": ([64], [256], False),
}


def load_old(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:minivllm/attention/cpu_paged_attention.cpp"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="cpu_attention_ab_")) / "old_paged_attention.cpp"
    path.write_text(source.replace("minivllm_cpu", "minivllm_cpu_old"))
    load(name=f"minivllm_cpu_old_{rev}", sources=[str(path)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False)
    return torch.ops.minivllm_cpu_old.paged_attention


def make_batch(query_lens, seq_lens, dtype, seed):
    """q, this step's k and v, caches over shuffled blocks, and metadata whose slots are the new tokens'."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // BLOCK) for s in seq_lens]
    k_cache, v_cache = (torch.randn(sum(need), BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    perm = torch.randperm(sum(need), generator=gen).tolist()
    tables = [perm[sum(need[:b]) : sum(need[: b + 1])] + [0] * (max(need) - n) for b, n in enumerate(need)]
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens))
             for p in range(seq_len - q_len, seq_len)]
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(sum(query_lens), KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32), max(query_lens),
                             max(seq_lens), list(query_lens), list(seq_lens))
    return q, k, v, k_cache, v_cache, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="37389f3", help="git revision of the kernel to compare against")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sets", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    old_op, new = load_old(args.old), cpu_attention.paged_attention if extension_built() else None
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter

    def old(q, k, v, k_cache, v_cache, meta, store):
        if store:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return old_op(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)

    def newer(q, k, v, k_cache, v_cache, meta, store):
        return new(q, k_cache, v_cache, meta, 0.125, *((k, v) if store else ()))

    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.sets} input set(s), old = {args.old}")
    for dtype_name in args.dtypes.split(","):
        for case in args.cases.split(","):
            query_lens, seq_lens, store = CASES[case]
            sets = [make_batch(query_lens, seq_lens, getattr(torch, dtype_name), seed) for seed in range(args.sets)]
            diff = (old(*sets[0], store).float() - newer(*sets[0], store).float()).abs().max().item()
            times: dict[str, list[float]] = {"old": [], "new": []}
            for rnd in range(args.rounds):
                for name, fn in [("old", old), ("new", newer)][:: 1 if rnd % 2 == 0 else -1]:
                    start = clock()
                    for inputs in sets:
                        fn(*inputs, store)
                    times[name].append((clock() - start) / len(sets) * 1e6)
            med = {n: statistics.median(t) for n, t in times.items()}
            low = {n: min(t) for n, t in times.items()}
            print(f"{dtype_name:8s} {case:14s} old {med['old']:7.0f} us  new {med['new']:7.0f} us  "
                  f"x{med['old'] / med['new']:4.2f}  (min {low['old']:.0f} / {low['new']:.0f}: "
                  f"x{low['old'] / low['new']:4.2f})  max diff {diff:.1e}  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
