"""Check the Triton attention kernels against the torch reference, then time decode attention on a GPU.

    python bench/gpu_kernels.py               # on a CUDA GPU: bf16/fp16 checks, then the timings
    python bench/gpu_kernels.py --cpu-check   # anywhere: the checks in fp32 on CPU, through Triton's interpreter

Decode is memory bound, so its figure of merit is bandwidth: bytes of K/V read per second, compared with
what a plain device-to-device copy achieves on the same GPU (the practical ceiling). Target: >= 70%.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

ARGS = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ARGS.add_argument("--cpu-check", action="store_true", help="only the correctness checks, fp32 on CPU (interpreter)")
ARGS.add_argument("--sweep", action="store_true", help="also time decode over tile sizes, warps and stages")
ARGS.add_argument("--batch", type=int, default=256)
ARGS.add_argument("--context", type=int, default=2048)


def parse_args():
    args = ARGS.parse_args()
    if args.cpu_check:  # must happen before triton is first imported: the kernels are built for the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    return args


@dataclass
class Batch:
    q: object  # torch tensors (torch is imported after the environment is set)
    k_cache: object
    v_cache: object
    meta: object


def make_batch(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Random caches, queries and metadata; each request owns randomly placed physical blocks."""
    import torch

    from minivllm.attention import AttentionMetadata

    torch.manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)  # made on the device: GBs in the timing runs
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n] + [0] * (max(need) - n))
        perm = perm[n:]
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return Batch(q, k_cache, v_cache, meta)


def half_dtype():
    """bf16 where the GPU has it natively (compute capability >= 8.0), else fp16 (a T4)."""
    import torch

    return torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16


def check(device: str, dtypes, small: bool) -> bool:
    """Every kernel against the torch reference (computed in fp32 from the same rounded inputs)."""
    import torch

    from minivllm.attention.torch_backend import paged_attention_ref, paged_decode_ref
    from minivllm.attention.torch_backend import store_kv as store_kv_ref
    from minivllm.kernels import paged_decode_attention, paged_prefill_attention, store_kv

    tol = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # max |error|
    # (block_size, heads, kv_heads, head_dim, query_lens, seq_lens)
    if small:
        shapes = [(8, 4, 2, 24, [1, 7, 1], [9, 30, 1]), (16, 4, 1, 32, [5, 1, 20], [40, 17, 20])]
    else:
        shapes = [(16, 32, 8, 128, [1, 300, 17, 1], [2049, 300, 500, 33]),
                  (16, 14, 2, 64, [1, 64, 1], [4097, 1000, 7]),
                  (32, 16, 16, 80, [129, 1, 3], [129, 3000, 700]),
                  (8, 8, 1, 96, [1, 40], [1, 77])]
    ok = True
    for dtype in dtypes:
        for i, (bs, heads, kv_heads, dim, q_lens, s_lens) in enumerate(shapes):
            batch = make_batch(q_lens, s_lens, bs, heads, kv_heads, dim, dtype, device, seed=i)
            ref = [t.float() for t in (batch.q, batch.k_cache, batch.v_cache)]
            scale = dim**-0.5
            meta = batch.meta
            errors = {}
            out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens, scale, meta.max_query_len)
            errors["prefill"] = (out.float() - paged_attention_ref(*ref, meta, scale)).abs().max().item()

            num = len(s_lens)  # the same contexts, each decoding one token
            meta.query_start_loc = torch.arange(num + 1, dtype=torch.int32, device=device)
            meta.max_query_len, meta.query_lens_cpu = 1, [1] * num
            q = batch.q[:num]
            want = paged_decode_ref(q.float(), *ref[1:], meta, scale)
            for splits in (1, 4):
                out = paged_decode_attention(q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
                                             scale, num_splits=splits)
                errors[f"decode/splits={splits}"] = (out.float() - want).abs().max().item()

            k, v = (torch.randn_like(batch.q[:num, :kv_heads]) for _ in range(2))
            slots = torch.tensor([j * bs + j % bs if j % 2 else -1 for j in range(num)], device=device)
            k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
            store_kv(k, v, k_cache, v_cache, slots)
            store_kv_ref(k, v, batch.k_cache, batch.v_cache, slots)
            same = torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)
            errors["store_kv"] = 0.0 if same else 1.0  # must be bit-exact

            good = all(e <= (0 if name == "store_kv" else tol[dtype]) for name, e in errors.items())
            ok &= good
            detail = ", ".join(f"{name} {e:.1e}" for name, e in errors.items())
            print(f"{'ok  ' if good else 'FAIL'} {str(dtype)[6:]:8} block {bs:2} heads {heads}/{kv_heads} "
                  f"dim {dim:3} q_lens {q_lens} seq_lens {s_lens}: max |err| {detail}")
    return ok


def check_fused(device: str, dtypes) -> bool:
    """The fused RMSNorm (+ residual), rotary and SwiGLU kernels against torch, at Qwen3-0.6B sizes."""
    import torch

    from minivllm.kernels import apply_rotary, rms_norm, silu_and_mul
    from minivllm.model.llama import RMSNorm
    from minivllm.model.rotary import RotaryEmbedding

    tol = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}  # max |error|, values of size ~3
    ok = True
    for dtype in dtypes:
        gen = torch.Generator(device=device).manual_seed(0)
        x, residual = (torch.randn(300, 1024, device=device, generator=gen).to(dtype) for _ in range(2))
        norm = RMSNorm(1024, 1e-6).to(device=device, dtype=dtype)
        out, summed = rms_norm(x, norm.weight, norm.eps, residual)
        want, want_sum = norm(x, residual)
        err_norm = max((out.float() - want.float()).abs().max().item(), (summed - want_sum).abs().max().item())
        rope = RotaryEmbedding(128, 4096, 1e6, None).to(device)
        rope.build()
        q = torch.randn(300, 16, 128, device=device, dtype=dtype)
        k = torch.randn(300, 8, 128, device=device, dtype=dtype)
        positions = torch.randint(0, 4096, (300,), device=device, generator=gen)
        got, want = apply_rotary(positions, q, k, rope.cos_sin), rope(positions, q, k)
        err_rope = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        gate_up = torch.randn(300, 2 * 3072, device=device, generator=gen).to(dtype)
        gate, up = gate_up.float().chunk(2, dim=-1)
        err_act = (silu_and_mul(gate_up).float() - torch.nn.functional.silu(gate) * up).abs().max().item()
        good = max(err_norm, err_rope, err_act) <= tol[dtype]
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {str(dtype)[6:]:8} fused add+RMSNorm max |err| {err_norm:.1e}, "
              f"rotary max |err| {err_rope:.1e}, silu(gate) * up max |err| {err_act:.1e}")
    return ok


def bench_decode(batch: int, context: int, sweep: bool) -> float:

    from minivllm.kernels import paged_decode_attention
    from minivllm.kernels.timing import copy_bandwidth, time_ms

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    b = make_batch([1] * batch, [context] * batch, bs, heads, kv_heads, dim, half_dtype(), "cuda")
    dtype_name = str(half_dtype())[6:]
    m, scale = b.meta, dim**-0.5
    kv_bytes = 2 * batch * context * kv_heads * dim * b.k_cache.element_size()  # K and V, each read once
    peak = copy_bandwidth()
    print(f"device-to-device copy: {peak / 1e9:.0f} GB/s")
    best = 0.0
    settings = [(64, 4, 2)]  # (block_n, num_warps, num_stages): the defaults
    if sweep:
        settings += [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)
                     if (bn, w, st) != (64, 4, 2)]
    for bn, warps, stages in settings:
        ms = time_ms(lambda bn=bn, w=warps, st=stages: paged_decode_attention(
            b.q, b.k_cache, b.v_cache, m.block_tables, m.seq_lens, scale, max_seq_len=context, block_n=bn,
            num_warps=w, num_stages=st))
        bw = kv_bytes / (ms * 1e-3)
        best = max(best, bw / peak)
        print(f"decode batch {batch} x {context} tokens, heads {heads}/{kv_heads}, dim {dim}, {dtype_name}, "
              f"block_n {bn}, warps {warps}, stages {stages}: {ms * 1e3:.0f} us, {bw / 1e9:.0f} GB/s of K/V "
              f"= {100 * bw / peak:.0f}% of copy")

    # Split-K where it matters: few requests with long contexts
    small = make_batch([1] * 4, [16384] * 4, bs, heads, kv_heads, dim, half_dtype(), "cuda", seed=1)
    sm = small.meta
    for splits in (1, None):
        ms = time_ms(lambda s=splits: paged_decode_attention(small.q, small.k_cache, small.v_cache, sm.block_tables,
                                                             sm.seq_lens, scale, max_seq_len=16384, num_splits=s))
        label = "off" if splits == 1 else "auto"
        print(f"decode batch 4 x 16384 tokens, split-K {label}: {ms * 1e3:.0f} us")
    return best


def bench_prefill() -> None:

    from minivllm.kernels import paged_prefill_attention
    from minivllm.kernels.timing import time_ms

    heads, kv_heads, dim = 32, 8, 128
    b = make_batch([2048] * 4, [2048] * 4, 16, heads, kv_heads, dim, half_dtype(), "cuda")
    m = b.meta
    ms = time_ms(lambda: paged_prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc,
                                                 m.seq_lens, dim**-0.5, m.max_query_len))
    flops = 4 * 4 * heads * dim * 2048 * 2048 / 2  # QK^T and PV, causal half
    print(f"prefill 4 x 2048 tokens (causal), {str(half_dtype())[6:]}: {ms:.2f} ms, "
          f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s")


def main() -> int:
    args = parse_args()
    import torch

    if args.cpu_check:
        ok = check("cpu", [torch.float32], small=True) & check_fused("cpu", [torch.float32])
        print("all checks passed" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-check to exercise the checks on CPU")
        return 1
    print(torch.cuda.get_device_name())
    halves = [torch.bfloat16, torch.float16] if half_dtype() == torch.bfloat16 else [torch.float16]
    ok = check("cuda", halves, small=False) & check_fused("cuda", halves)
    best = bench_decode(args.batch, args.context, args.sweep)
    bench_prefill()
    print(f"decode bandwidth: {100 * best:.0f}% of copy bandwidth (target >= 70%): "
          f"{'met' if best >= 0.7 else 'NOT met'}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
