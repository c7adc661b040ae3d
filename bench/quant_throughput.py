"""CPU speed of quantized weights: bf16 vs int8 vs GPTQ / AWQ 4-bit vs a GGUF file, minivllm and transformers.

    python bench/quant_throughput.py [--hidden 1024 --intermediate 2816 --layers 8] [--requests 16]

The embedded model is too small for weights to matter (its matmuls take a fraction of a step), so a random
Llama of the given size is built once under --workdir (vocabulary and tokenizer of the embedded model), with
copies written by our packer in GPTQ and AWQ layout (groups of 128) and as a GGUF file (Q8_0 matrices).
Everything runs with bf16 activations. All engines are loaded first, then measured in --repeats rounds,
each round running every configuration once (so a busy spell on a shared machine hits all of them); each
figure is a configuration's best round:

1. decode at batch 1: ms per output token over 64 tokens (weights read once per token: the memory-bound case);
2. offline throughput: --requests requests, prompt and output lengths uniform in [16, 128], greedy, ignore_eos;
3. the CPU 4-bit matmul alone, per batch size: torch's int4 kernel against dequantize-then-matmul.

transformers runs the float model and the GGUF file (it dequantizes GGUF at load); it cannot run GPTQ/AWQ
here without the gptqmodel / autoawq packages, and says so.
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
from minivllm.quantization import weight_bytes  # noqa: E402


def build(workdir: Path, hidden: int, intermediate: int, layers: int) -> dict[str, Path]:
    """The float checkpoint and its quantized copies (built once; delete --workdir to rebuild)."""
    import shutil

    import transformers as tf

    from minivllm.quantization.gguf import write_gguf
    from minivllm.quantization.packing import write_quantized_checkpoint

    paths = {"bf16": workdir / "float", "gptq": workdir / "gptq", "awq": workdir / "awq",
             "gguf": workdir / "model.Q8_0.gguf"}
    if all(p.exists() for p in paths.values()):
        return paths
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1834, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.05)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(paths["bf16"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, paths["bf16"] / name)
    for fmt in ("gptq", "awq"):
        write_quantized_checkpoint(paths["bf16"], paths[fmt], fmt, group_size=128)
    write_gguf(paths["gguf"], model.float(), DEFAULT_MODEL, mlp_type="Q8_0", attention_type="Q8_0")
    return paths


def ours(runs, work, repeats: int) -> dict[str, dict]:
    """{name: weight bytes, best decode ms per token at batch 1, best throughput}, measured round-robin."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    one = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engines, out = {}, {}
    for name, path, quantization in runs:
        engines[name] = llm = LLM(str(path), dtype="bfloat16", quantization=quantization, num_kv_blocks=2048,
                                  trace_steps=0)
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
        out[name] = {"bytes": weight_bytes(llm.engine.runner.model), "decode_ms": float("inf"), "tok_s": 0.0}
    for _ in range(repeats):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([prompts[0]], one, use_tqdm=False)
            out[name]["decode_ms"] = min(out[name]["decode_ms"], (time.perf_counter() - start) * 1000 / 64)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            out[name]["tok_s"] = max(out[name]["tok_s"], sum(n for _, n in work) / (time.perf_counter() - start))
    return out


def theirs(path: Path, work, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    kwargs = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=torch.bfloat16,
                                                     **kwargs).eval()
    except Exception as e:  # noqa: BLE001 - reported: transformers cannot load this format here
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    out = {"decode_ms": float("inf"), "tok_s": 0.0}
    with torch.inference_mode():
        ids = torch.tensor([work[0][0]])
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            out["decode_ms"] = min(out["decode_ms"], (time.perf_counter() - start) * 1000 / 64)
            out["tok_s"] = max(out["tok_s"], max(transformers_throughput(model, work, b)[0] for b in (8, 16)))
    return out


def int4_matmul_table(k: int, n: int, group: int = 128) -> list[tuple[int, float, float, float]]:
    """(batch, bf16 F.linear ms, int4 kernel ms, dequantize-then-matmul ms) for one [n, k] layer."""
    from minivllm.quantization.int4 import dequantize, pack_rows, unpack_rows
    from minivllm.quantization.packing import quantize_groups

    q, z, s = quantize_groups(torch.randn(n, k) * 0.05, group)
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.T.contiguous(), 1)
    sz = torch.stack([s.float(), (8 - z.float()) * s.float()], -1).to(torch.bfloat16)
    words, zeros, scales = pack_rows(q), z.to(torch.uint8), s.to(torch.bfloat16)

    def best(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1000

    rows = []
    for m in (1, 4, 16, 64, 256):
        x = torch.randn(m, k).to(torch.bfloat16)
        rows.append((m, best(lambda: torch.nn.functional.linear(x, w)),  # noqa: B023
                     best(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)),  # noqa: B023
                     best(lambda: x @ dequantize(unpack_rows(words), zeros, scales, group).to(torch.bfloat16))))  # noqa: B023
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/minivllm-quant-bench")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    paths = build(Path(args.workdir), args.hidden, args.intermediate, args.layers)
    work = make_workload(args.requests, (16, 128), (16, 128), 1834)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"model: random Llama, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers; "
          f"{len(work)} requests, {sum(n for _, n in work)} output tokens; bf16 activations")
    runs = [("minivllm bf16", paths["bf16"], None), ("minivllm int8 (weight-only)", paths["bf16"], "int8"),
            ("minivllm GPTQ 4-bit (g128)", paths["gptq"], None), ("minivllm AWQ 4-bit (g128)", paths["awq"], None),
            ("minivllm GGUF Q8_0 (dequantized)", paths["gguf"], None),
            ("minivllm GGUF Q8_0 -> int8", paths["gguf"], "int8")]
    results = ours(runs, work, args.repeats)
    base = results["minivllm bf16"]
    print("\n| engine / weights | weight bytes | decode, batch 1 (ms/token) | throughput (output tok/s) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['bytes'] / 2**20:.0f} MiB ({r['bytes'] / base['bytes']:.0%}) | {r['decode_ms']:.1f} "
              f"({base['decode_ms'] / r['decode_ms']:.2f}x) | {r['tok_s']:.0f} ({r['tok_s'] / base['tok_s']:.2f}x) |")
    if not args.skip_transformers:
        for name, path in (("transformers bf16", paths["bf16"]), ("transformers GGUF Q8_0 (dequantized)",
                                                                 paths["gguf"]), ("transformers GPTQ", paths["gptq"])):
            r = theirs(path, work, args.repeats)
            if "error" in r:
                print(f"| {name} | cannot load here: {r['error']} | | |")
            else:
                print(f"| {name} | | {r['decode_ms']:.1f} | {r['tok_s']:.0f} (best static batch of 8, 16) |")
    print(f"\nOne {args.hidden} -> {args.intermediate} layer (gate or up projection), bf16 activations, ms:")
    print("| batch | bf16 F.linear | int4 kernel | dequantize + matmul |\n|---|---|---|---|")
    for m, dense, kernel, deq in int4_matmul_table(args.hidden, args.intermediate):
        print(f"| {m} | {dense:.2f} | {kernel:.2f} | {deq:.2f} |")


if __name__ == "__main__":
    main()
