"""End-to-end offline throughput on a GPU: the workload nano-vllm reports, minivllm against transformers.

Workload (as in nano-vllm's bench.py): 256 requests of random token ids, prompt and output lengths uniform
in [100, 1024], ignore_eos, temperature 0.6, seed 0. Models are randomly initialised from the configs of
Qwen3-0.6B and TinyLlama-1.1B (written out below: nothing is downloaded), in bf16 (fp16 below sm 8.0).
transformers `generate` runs the same requests, sampling at the same temperature, in static batches on the
same GPU. Before timing, a tiny fp32 model checks that CUDA-graph decoding gives transformers' greedy tokens
(with --cpu-check: the same padded batches, run eagerly).

    python bench/gpu_throughput.py                     # both shapes, on the GPU
    python bench/gpu_throughput.py --models qwen3-0.6b --hf-batch-sizes 64,128
    python bench/gpu_throughput.py --cpu-check         # the whole script on CPU, shrunken models and workload

Targets on one H100 (issue 7): >= 15,000 output tok/s on the Qwen3-0.6B shape, and >= 10x transformers.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_workload, transformers_throughput  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import DEFAULT_MOE_MODEL  # noqa: E402

SHAPES = {  # the published configs of the two models, minus their weights
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False),
}
SHRUNK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)  # --cpu-check: same families, toy sizes


def write_checkpoint(shape: dict, path: Path, dtype: torch.dtype, device: str) -> None:
    """A randomly initialised model of this shape, saved as a Hugging Face checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, torch_dtype=dtype, bos_token_id=None,
                                  eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of minutes for 150k x 1024 embeddings
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    del model


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_minivllm(path: Path, work, args, **engine_args) -> tuple[float, float, dict]:
    llm = LLM(str(path), trace_steps=0, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, **engine_args)
    # warm-up: every kernel variant the run will need (prefill tiles, mixed steps) is compiled before timing;
    # its prompts are reversed copies, so the timed run finds none of its own in the prefix cache
    llm.generate([{"prompt_token_ids": p[::-1]} for p, _ in work[:16]], SamplingParams(max_tokens=16),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in work]
    graphs = llm.engine.runner.graphs
    replays_before = graphs.num_replays if graphs is not None else 0
    steps_before = llm.engine.num_steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    assert total == sum(n for _, n in work), "every request produced exactly max_tokens tokens"
    stats = llm.engine.stats()
    stats["num_steps"] -= steps_before
    stats["graph_steps"] = graphs.num_replays - replays_before if graphs is not None else 0
    del llm, outs, graphs  # the graphs hold the model and KV cache too
    free_memory()
    return total / seconds, seconds, stats


def run_transformers(path: Path, work, batch_sizes: list[int], dtype: torch.dtype, device: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    transformers_throughput(model, work[:2], 2, temperature=0.6)  # warm-up
    best = (0.0, 0)
    for bs in batch_sizes:
        torch.manual_seed(0)
        tps, secs = transformers_throughput(model, work, bs, temperature=0.6)
        print(f"  transformers generate, batch {bs:3}: {tps:9.1f} output tok/s ({secs:.1f} s)")
        best = max(best, (tps, bs))
    del model
    free_memory()
    return best


def check_graph_decoding(device: str) -> bool:
    """Greedy tokens with CUDA graphs (captured for real on a GPU) equal transformers', in fp32: a tiny dense
    Qwen3, the embedded mixture of experts (its fused-MoE kernel builds its tile table without the host), and the
    embedded model as a GGUF file (attention Q4_0, MLP Q8_0: kernels/gguf_linear.py reads the blocks)."""
    from minivllm.config import DEFAULT_MODEL
    from minivllm.quantization.gguf import write_gguf

    shape = dict(SHAPES["qwen3-0.6b"], **SHRUNK, vocab_size=512, max_position_embeddings=512)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(dict(shape, initializer_range=0.2), Path(tmp), torch.float32, device)
        dense = graph_tokens_match(tmp, device, "tiny Qwen3")
    moe = graph_tokens_match(str(DEFAULT_MOE_MODEL), device, "embedded MoE")
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        write_gguf(Path(tmp) / "tiny.gguf", AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL), DEFAULT_MODEL)
        blocks = graph_tokens_match(str(Path(tmp) / "tiny.gguf"), device, "embedded model, GGUF Q4_0/Q8_0")
    return dense and moe and blocks


def graph_tokens_match(path: str, device: str, label: str) -> bool:
    from transformers import AutoModelForCausalLM

    gguf = dict(gguf_file=Path(path).name) if path.endswith(".gguf") else {}
    source = Path(path).parent if gguf else path
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **gguf).to(device).eval()
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 3, 100, 9, 64, 2, 33, 12)]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device=device), max_new_tokens=40, min_new_tokens=40,
                          do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    llm = LLM(path, dtype="float32", num_kv_blocks=256, trace_steps=0)
    if device == "cpu":  # --cpu-check: nothing can be recorded, so run the same padded buffers eagerly
        from minivllm.runner.cuda_graphs import DecodeGraphs, capture_sizes

        runner, cfg = llm.engine.runner, llm.engine.config
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, capture_sizes(cfg.max_num_seqs),
                                     -(-cfg.max_model_len // cfg.block_size), runner.device, lambda size: 1,
                                     capture=False)
    # min_tokens: EOS masked to the end, as transformers' min_new_tokens does (a trained model would stop)
    params = [SamplingParams(temperature=0, max_tokens=40 - 3 * i, min_tokens=40 - 3 * i) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    graphs = llm.engine.runner.graphs
    same = all(o.outputs[0].token_ids == w[: sp.max_tokens] for o, w, sp in zip(outs, want, params))
    captured = sorted(graphs.graphs if graphs.use_graphs else graphs.sizes) if graphs is not None else []
    replays = graphs.num_replays if graphs is not None else 0
    print(f"CUDA-graph decoding, fp32 {label}, {len(prompts)} prompts, batches shrinking 10 -> 1: "
          f"{'same tokens as transformers' if same else 'TOKENS DIFFER from transformers'}; "
          f"{'graphs captured' if device != 'cpu' else 'padded eager batches (CPU)'} for sizes "
          f"{captured[:6]}{'...' if len(captured) > 6 else ''}, {replays} decode steps went through them")
    del llm, hf, graphs
    free_memory()
    return same and replays > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,tinyllama-1.1b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hf-batch-sizes", default="64", help="transformers' static batch sizes to try")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="as nano-vllm's benchmark")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--no-eager", action="store_true", help="skip the run without CUDA graphs")
    ap.add_argument("--cpu-check", action="store_true", help="run everything on CPU at toy sizes")
    args = ap.parse_args()

    import transformers
    import triton

    cuda = torch.cuda.is_available() and not args.cpu_check
    if not cuda and not args.cpu_check:
        print("no CUDA device: run with --cpu-check to exercise the script on CPU")
        return 1
    device = "cuda" if cuda else "cpu"
    if cuda:
        dtype = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        dtype = torch.float32
        args.requests, args.min_len, args.max_len, args.hf_batch_sizes = 8, 8, 32, "4"
        args.max_num_batched_tokens, args.max_model_len = 512, 128
        print(f"device: CPU ({platform.machine()}), --cpu-check: toy models and workload")
    print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")

    ok = check_graph_decoding(device)
    work = make_workload(args.requests, (args.min_len, args.max_len), (args.min_len, args.max_len), 10000)
    print(f"workload: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
          f"{sum(n for _, n in work)} output tokens, temperature 0.6, ignore_eos, {str(dtype)[6:]}")
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    for name in args.models.split(","):
        shape = dict(SHAPES[name], **(SHRUNK if not cuda else {}))
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(shape, Path(tmp), dtype, device)
            print(f"{name}: random weights, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}")
            ours, secs, stats = run_minivllm(Path(tmp), work, args)
            print(f"  minivllm:                         {ours:9.1f} output tok/s ({secs:.1f} s, "
                  f"{stats['num_steps']} steps of which {stats['graph_steps']} replayed CUDA graphs, "
                  f"{stats['num_preemptions']} preemptions)")
            if cuda and not args.no_eager:
                eager, secs, _ = run_minivllm(Path(tmp), work, args, enforce_eager=True)
                print(f"  minivllm, enforce_eager:          {eager:9.1f} output tok/s ({secs:.1f} s): "
                      f"graphs {ours / eager:.2f}x")
            hf, bs = run_transformers(Path(tmp), work, batch_sizes, dtype, device)
            print(f"  ratio minivllm / transformers (batch {bs}): {ours / hf:.1f}x")
            if cuda and name == "qwen3-0.6b":
                met = ours >= 15000 and ours / hf >= 10
                print(f"  targets (>= 15000 tok/s, >= 10x): {'met' if met else 'NOT met'}")
    print("graph check passed" if ok else "GRAPH CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
