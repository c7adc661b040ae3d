"""llama.cpp as a peer at batch 1 (issue 37): the same weights, converted by llama.cpp's own converter.

The checkpoint is bench/cpu_peer.py's random 135M-shaped Llama (seed 0, float32 safetensors). llama.cpp's
`convert_hf_to_gguf.py` (shipped in the vendor directory of llama-cpp-python's source package) needs a tokenizer:
a small SentencePiece model trained here on the repository's own text gives it one; the converter pads its
vocabulary to the config's 49,152 entries, and every engine is fed the same token ids, so the tokenizer
changes nothing that is timed. Formats: GGUF f32, bf16 and q8_0 straight from the converter; q4_0, q4_1 and
q4_k_m from the f32 file through llama.cpp's own `llama_model_quantize`.

Rows, each in its own subprocess, engines alternating within each round:
- `llama.cpp <fmt>`: llama-cpp-python on the GGUF file, 2 threads, greedy (top_k=1).
- `minivllm <dtype>`: the safetensors checkpoint at float32 / bfloat16.
- `minivllm gguf <fmt>`: the same GGUF file llama.cpp ran (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K layers kept as
  the file's blocks on the cpu platform, minivllm/model/gguf_blocks.py; float files dequantized at load).
- `minivllm gguf-int8 <fmt>` (block formats): the same, its layers multiplying x quantized to int8 as llama.cpp does
  (MINIVLLM_CPU_GGUF_ACTIVATIONS=int8; dtype "auto" is fp32 on a CPU without native bf16, where the default
  keeps x float).
Each reports ms per output token after the first (a 128-token prompt, 128 outputs, ignore EOS), time to
first token, resident memory after load (minivllm also the bytes its parameters and buffers hold), and the
first 16 greedy tokens (llama.cpp and minivllm on the same f32 weights should agree). The floor is a read-only
pass over the weight bytes at the machine's read bandwidth, measured in the same run (torch.sum over 512 MiB,
best of 5).

    python bench/llama_cpp_peer.py --llama-python /tmp/llama-venv/bin/python \
        --convert-python /tmp/convert-venv/bin/python --llama-src /tmp/llsrc/x/llama_cpp_python-0.3.36 \
        [--formats f32,bf16,q8_0,q4_0,q4_1,q4_k_m] [--rounds 2] [--workdir /tmp/llamacpp-bench]

The llama venv holds llama-cpp-python (pip install llama-cpp-python; it compiles llama.cpp); the convert
venv holds torch, transformers and sentencepiece (python -m venv --system-site-packages + pip install
sentencepiece). Neither is a dependency of minivllm, its tests or CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from cpu_peer import VOCAB, build_checkpoint, machine_info, tree_rss_mib  # noqa: E402

PROMPT, OUTPUT, SHOWN = 128, 128, 16
CONVERTER_TYPES = {"f32": "f32", "bf16": "bf16", "q8_0": "q8_0"}
# llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_0 / _Q4_1 / _Q4_K_M (the mix most downloaded files are: Q4_K, some
# tensors Q6_K, and rows whose length is not a multiple of 256 in llama.cpp's fallback types)
QUANTIZED_FROM_F32 = {"q4_0": 2, "q4_1": 3, "q4_k_m": 15}
HF_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def prompt_ids() -> list[int]:
    import random

    rng = random.Random(1)
    return [rng.randrange(10, VOCAB) for _ in range(PROMPT)]


# ---- children: one engine each, one JSON line on stdout ------------------------------------------------------
def child_llama_cpp(spec: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=spec["path"], n_ctx=512, n_batch=512, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], verbose=False)
    rss = tree_rss_mib()

    def run(n: int) -> tuple[float, float, list[int]]:
        llm.reset()
        tokens, start, ttft = [], time.perf_counter(), 0.0
        for tok in llm.generate(prompt_ids(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if not tokens:
                ttft = time.perf_counter() - start
            tokens.append(tok)
            if len(tokens) == n:
                break
        return ttft, time.perf_counter() - start, tokens

    run(8)  # warm-up
    ttft, total, tokens = run(OUTPUT)
    return dict(ttft_ms=ttft * 1e3, ms_per_tok=(total - ttft) / (OUTPUT - 1) * 1e3, rss_mib=rss,
                tokens=tokens[:SHOWN])


def child_minivllm(spec: dict) -> dict:
    os.environ.update(spec.get("env", {}))
    from minivllm import LLM, SamplingParams

    llm = LLM(spec["path"], dtype=spec["dtype"], trace_steps=0,
              kv_cache_memory_bytes=1 << 30)
    rss = tree_rss_mib()
    from minivllm.quantization import held_bytes

    held_mib = held_bytes(llm.engine.runner.model) / 2**20

    def run(n: int) -> tuple[float, float, list[int]]:
        engine, rid = llm.engine, f"b1-{time.monotonic_ns()}"
        start, ttft, tokens = time.perf_counter(), None, []
        engine.add_request(rid, {"prompt_token_ids": prompt_ids()},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - start
                tokens = list(out.outputs[0].token_ids)
        return ttft, time.perf_counter() - start, tokens

    run(8)  # warm-up
    ttft, total, tokens = run(OUTPUT)
    return dict(ttft_ms=ttft * 1e3, ms_per_tok=(total - ttft) / (OUTPUT - 1) * 1e3, rss_mib=rss,
                held_mib=held_mib, tokens=tokens[:SHOWN])


def child_floor(spec: dict) -> dict:
    """Read bandwidth: the best of five sums over 512 MiB (a read-only pass, as a decode step's weights)."""
    import torch

    torch.set_num_threads(spec["threads"])
    data = torch.ones(512 * 2**20 // 4, dtype=torch.float32)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return dict(read_gb_s=data.nbytes / best / 1e9)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CHILDREN = {"llama.cpp": child_llama_cpp, "minivllm": child_minivllm, "floor": child_floor}


# ---- parent ---------------------------------------------------------------------------------------------------
def converter_input(checkpoint: Path, convert_python: str) -> Path:
    """The checkpoint's files linked beside a 400-piece SentencePiece model with byte fallback: what the
    converter needs to write a vocabulary (kept out of the checkpoint itself, which stays tokenizer-free)."""
    linked = checkpoint.with_name(checkpoint.name + "-with-tokenizer")
    if (linked / "tokenizer.model").exists():
        return linked
    linked.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if not (linked / name).exists():
            (linked / name).symlink_to(checkpoint / name)
    text = "\n".join(p.read_text() for p in sorted((BENCH.parent / "chapters").glob("*.py")))
    corpus = linked / "corpus.txt"
    corpus.write_text(text)
    code = ("import sentencepiece as spm, sys; spm.SentencePieceTrainer.train(input=sys.argv[1], "
            "model_prefix=sys.argv[2], vocab_size=400, model_type='bpe', byte_fallback=True, "
            "unk_id=0, bos_id=1, eos_id=2, pad_id=-1)")
    subprocess.run([convert_python, "-c", code, str(corpus), str(linked / "tokenizer")], check=True,
                   capture_output=True)
    return linked


def convert(checkpoint: Path, fmt: str, args) -> Path:
    out = Path(args.workdir) / f"135m-{fmt}.gguf"
    if out.exists():
        return out
    if fmt in CONVERTER_TYPES:
        script = Path(args.llama_src) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        subprocess.run([args.convert_python, str(script), str(checkpoint), "--outtype", CONVERTER_TYPES[fmt],
                        "--outfile", str(out)], check=True, capture_output=True)
    else:
        source = convert(checkpoint, "f32", args)
        code = ("import llama_cpp, sys; p = llama_cpp.llama_model_quantize_default_params(); "
                "p.ftype = int(sys.argv[3]); p.nthread = 2; "
                "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        subprocess.run([args.llama_python, "-c", code, str(source), str(out), str(QUANTIZED_FROM_F32[fmt])],
                       check=True, capture_output=True)
    return out


def run_child(engine: str, spec: dict, args) -> dict:
    python = args.llama_python if engine == "llama.cpp" else sys.executable
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent))
    load = os.getloadavg()[0]
    proc = subprocess.run([python, __file__, "--child", engine, "--spec", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return dict(error=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]), load=[round(load, 2), round(os.getloadavg()[0], 2)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child"), p.add_argument("--spec")
    p.add_argument("--llama-python", default="/tmp/llama-venv/bin/python")
    p.add_argument("--convert-python", default="/tmp/convert-venv/bin/python")
    p.add_argument("--llama-src", default="/tmp/llsrc/x/llama_cpp_python-0.3.36")
    p.add_argument("--formats", default="f32,bf16,q8_0,q4_0,q4_1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", default="/tmp/llamacpp-bench")
    p.add_argument("--child-timeout", type=int, default=900)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(CHILDREN[args.child](json.loads(args.spec))), flush=True)
        return

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "135m"
    if not (checkpoint / "model.safetensors").exists():
        build_checkpoint("135m", work)
    formats = args.formats.split(",")
    source = converter_input(checkpoint, args.convert_python)
    files = {fmt: convert(source, fmt, args) for fmt in formats}
    rows: dict[str, tuple[str, dict]] = {}
    for fmt in formats:
        rows[f"llama.cpp {fmt}"] = ("llama.cpp", dict(path=str(files[fmt]), threads=args.threads))
        rows[f"minivllm gguf {fmt}"] = ("minivllm", dict(path=str(files[fmt]), dtype="auto"))
        if fmt not in HF_DTYPES:  # block layers: x as int8, as llama.cpp multiplies (the default in bf16)
            rows[f"minivllm gguf-int8 {fmt}"] = ("minivllm", dict(
                path=str(files[fmt]), dtype="auto", env={"MINIVLLM_CPU_GGUF_ACTIVATIONS": "int8"}))
        if fmt in HF_DTYPES:
            rows[f"minivllm {fmt}"] = ("minivllm", dict(path=str(checkpoint), dtype=HF_DTYPES[fmt]))
    results: dict[str, list[dict]] = {name: [] for name in rows}
    floors = []
    for rnd in range(args.rounds):
        floors.append(run_child("floor", dict(threads=args.threads), args))
        for name in (list(rows) if rnd % 2 == 0 else list(rows)[::-1]):  # alternate the order each round
            engine, spec = rows[name]
            results[name].append(run_child(engine, spec, args))
            print(f"round {rnd + 1} {name}: {json.dumps(results[name][-1])[:300]}", flush=True)
    report(results, files, floors, machine_info())


def report(results: dict, files: dict, floors: list[dict], machine: dict) -> None:
    gb_s = statistics.median(f["read_gb_s"] for f in floors if "read_gb_s" in f)
    print(f"\nmachine: {json.dumps(machine)}\nread bandwidth (median of rounds): {gb_s:.1f} GB/s")
    print(f"{'engine':24} {'ms/token':>9} {'floor x':>8} {'TTFT ms':>8} {'RSS MiB':>8} {'held MiB':>9} "
          f"{'file MiB':>9}  first tokens")
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            print(f"{name:24} error: {runs[-1]['error'][-300:]}")
            continue
        fmt = name.split()[-1]
        size = files[fmt].stat().st_size
        ms = statistics.median(r["ms_per_tok"] for r in ok)
        floor_ms = size / (gb_s * 1e9) * 1e3
        print(f"{name:24} {ms:9.2f} {ms / floor_ms:8.2f} {statistics.median(r['ttft_ms'] for r in ok):8.1f} "
              f"{statistics.median(r['rss_mib'] for r in ok):8.0f} {ok[-1].get('held_mib', float('nan')):9.1f} "
              f"{size / 2**20:9.0f}  {ok[-1]['tokens'][:8]}"
              f"  loads {[r['load'] for r in ok]}")


if __name__ == "__main__":
    main()
