# ---
# jupyter:
#   accelerator: GPU
#   colab:
#     gpuType: T4
#     provenance: []
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · Quantization
#
# A Colab T4 has 16 GB. An 8B model in bf16 needs 16 GB for its weights alone, so most small models on the
# Hub come quantized: their weights stored in fewer bits, as **GPTQ** or **AWQ** 4-bit checkpoints or as
# llama.cpp's **GGUF** files. vLLM serves them with `LLM(..., quantization="awq")` or
# `vllm serve ... --quantization gptq`; minivllm does the same (`quantization=None` follows the checkpoint):
#
# | format | bits per weight | where the scales live | minivllm |
# |---|---|---|---|
# | FP16 / BF16 | 16 | none | the default |
# | INT8 weight-only | 8 | one per output channel | `quantization="int8"`, quantized as any float checkpoint loads |
# | GPTQ 4-bit | 4 | a scale and a zero point per group of 128 inputs | detected from `config.json` |
# | AWQ 4-bit | 4 | the same, another packing order | detected from `config.json` |
# | GGUF Q8_0 / Q4_0 | 8.5 / 4.5 | an fp16 scale per block of 32 | `LLM("model.gguf")`: kept as blocks, CPU and GPU |
# | GGUF Q4_K / Q6_K | 4.5 / 6.6 | 6/8-bit scales per 32/16 weights, fp16 ones per 256 | the same |
# | FP8 weights (Hopper) | 8 | per tensor | refused here |
# | **FP8 KV cache** (K and V, not weights) | 8 | a K and a V scale per layer | `kv_cache_dtype="fp8"` |
#
# A GGUF file's blocks are multiplied as stored. On a CPU with bf16 they also take llama.cpp's arithmetic:
# x rounded to 8 bits per 32 values and multiplied in integers (`MINIVLLM_CPU_GGUF_ACTIVATIONS`); in fp32
# x stays float and the tokens equal transformers'.
#
# This chapter does the arithmetic first (what fits a T4, computed by the engine's own sizing code), then
# quantizes the embedded model two ways and its KV cache two ways and measures what it costs, looks inside a
# 4-bit word, and ends with an exercise: the int8 quantizer, graded by the engine.

# %%
# Setup: on Colab, fetch the repository and install it; anywhere else this cell does nothing.
import os
import subprocess
import sys

REPO = "https://github.com/minivllm/minivllm"
if "google.colab" in sys.modules:
    if not os.path.isdir("/content/minivllm"):
        subprocess.run(["git", "clone", "--depth", "1", REPO, "/content/minivllm"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/minivllm"], check=True)
    sys.path.insert(0, "/content/minivllm")

# %%
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from transformers import LlamaConfig

from minivllm import LLM, SamplingParams, widgets
from minivllm.config import DEFAULT_MODEL
from minivllm.core.kv_sizing import gpu_kv_budget, kv_bytes_per_block, kv_bytes_per_token, num_blocks_for_budget
from minivllm.model import read_model_config
from minivllm.quantization import weight_bytes
from minivllm.quantization.kv_cache import kv_cache_torch_dtype
from minivllm.quantization.sizing import model_weight_bytes

GiB = 2**30

# %% [markdown]
# ## Bytes per weight, bytes per KV token
#
# Two things fill a GPU: the weights, read once per step, and the KV cache, which grows with every token of
# every running request. Quantizing the weights shrinks the first; storing K and V in fp8 halves the
# second. `model_weight_bytes` (`minivllm/quantization/sizing.py`) counts a model's weights in each format:
# linear layers in the format, embeddings, LM head and norms in fp16, as the 4-bit formats keep them;
# `kv_bytes_per_token` is the engine's own KV formula (chapter 02). Three configs: Llama-2-7B, Llama-3-8B
# (no weights needed: the engine reads a config the way it reads a checkpoint's), and the embedded model.

# %%
def model_config_of(**hf_config):
    """The engine's view of a transformers config, read the way it reads a checkpoint's config.json."""
    with tempfile.TemporaryDirectory() as d:
        LlamaConfig(**hf_config).save_pretrained(d)
        return read_model_config(d)


MODELS = {
    "Llama-2-7B": model_config_of(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "Llama-3-8B": model_config_of(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "minivllm-tiny": read_model_config(DEFAULT_MODEL),
}
FORMATS = {"fp16": "float", "int8": "int8", "4-bit g128": "gptq", "GGUF Q4_0": "gguf-Q4_0"}
print("weights in GiB (4-bit g128: GPTQ or AWQ, a scale and a zero point per group of 128 inputs),")
print("then K and V per token of context")
print(f"{'model':14s}" + "".join(f"{f:>11s}" for f in FORMATS) + f"{'KV/token fp16':>15s}{'fp8':>9s}")
for name, mc in MODELS.items():
    sizes = [model_weight_bytes(mc, fmt, dtype_bytes=2) for fmt in FORMATS.values()]
    kv16, kv8 = (kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                    kv_cache_torch_dtype(kv, torch.float16).itemsize) for kv in ("auto", "fp8"))
    kv = f"{kv16 / 1024:11.0f} KiB{kv8 / 1024:5.0f} KiB"
    print(f"{name:14s}" + "".join(f"{s / GiB:11.3f}" for s in sizes) + kv)
llama2 = MODELS["Llama-2-7B"]
# The formula gives Llama-2-7B's well-known 512 KiB of KV cache per token in 16-bit.
assert kv_bytes_per_token(llama2.num_layers, llama2.num_kv_heads, llama2.head_dim, 2) == 512 * 1024

# %% [markdown]
# A 4-bit Llama-2-7B is 3.6 GiB instead of 12.6; Llama-3-8B's vocabulary of 128k tokens keeps 2 GiB of
# embeddings and head in fp16 whatever the format. Per token of context, Llama-2-7B needs half a MiB of
# K and V (32 KV heads); Llama-3-8B, with grouped-query attention (8 KV heads), a quarter of that.
#
# ## What fits a T4
#
# The engine sizes the KV cache as vLLM does (chapter 02): `gpu_memory_utilization` (0.9) of the GPU,
# minus the weights and the activations' peak, divided into blocks of 16 tokens. Colab's T4 shows about
# 15 GiB to torch; we assume 1 GiB of activations (on a real GPU the engine profiles it). The KV element
# comes from the engine's own `kv_cache_torch_dtype`: the model's fp16 for `kv_cache_dtype="auto"`, one byte
# for `"fp8"`.

# %%
T4_BYTES, ACTIVATIONS, BLOCK = 15 * GiB, 1 * GiB, 16
print(f"{'model':12s} {'weights':>22s} {'kv_cache_dtype':>15s} {'blocks':>8s} {'tokens of context':>18s}")
t4_blocks = {}
for name in ("Llama-2-7B", "Llama-3-8B"):
    mc = MODELS[name]
    for label, fmt in (("fp16", "float"), ("int8", "int8"), ("4-bit", "gptq")):
        weights = model_weight_bytes(mc, fmt)
        for kv in ("auto", "fp8"):
            element = kv_cache_torch_dtype(kv, torch.float16).itemsize  # 2, or 1 for fp8
            budget = gpu_kv_budget(T4_BYTES, 0.9, weights + ACTIVATIONS)
            blocks = max(0, num_blocks_for_budget(budget, kv_bytes_per_block(mc.num_layers, BLOCK, mc.num_kv_heads,
                                                                              mc.head_dim, element)))
            t4_blocks[name, label, kv] = blocks
            print(f"{name:12s} {label:>6s} ({weights / GiB:5.1f} GiB) {kv:>15s} {blocks:8d} {blocks * BLOCK:18,d}")
# An fp8 KV cache holds about twice the blocks of a 16-bit one in the same memory.
assert t4_blocks["Llama-3-8B", "4-bit", "fp8"] >= 1.99 * t4_blocks["Llama-3-8B", "4-bit", "auto"]

# %% [markdown]
# In fp16 neither model fits at all: 12.6 and 15 GiB of weights leave nothing for the cache. int8 makes
# both fit: about twelve thousand tokens of context for Llama-2-7B (32 KV heads make each of its tokens
# four times as expensive as Llama-3-8B's), over thirty thousand for Llama-3-8B. 4-bit weights leave more
# again, and an fp8 cache doubles every figure (each block costs half the bytes). That is why a T4 learner
# downloads GPTQ and AWQ checkpoints and passes `kv_cache_dtype="fp8"` (`--kv-cache-dtype fp8` to the
# server), in vLLM as here.
#
# ## The embedded model, quantized two ways
#
# Now measured rather than computed. The embedded model is quantized to **int8** as it loads, and to
# **4-bit GPTQ** by minivllm's own packer (`minivllm/quantization/packing.py`: round-to-nearest per group
# of 32 inputs, written in GPTQ's published layout, then loaded back like any Hub checkpoint); then, with
# float weights, its **KV cache** is stored in fp8, both formats. Against the float model (fp32, so the
# comparison sees only the quantization): bytes of weights as loaded, greedy agreement (the fraction of
# 32-token continuations' positions where the quantized model picks the float model's token), perplexity
# on held-out stories from the project's corpus generator (`data/corpus.py`, a seed the training never saw),
# each scored with the engine's own `prompt_logprobs`, and the largest change of any of those stories'
# token logprobs.

# %%
sys.path.insert(0, str(Path(DEFAULT_MODEL).parents[3] / "data"))  # the repository's data/: the corpus generator
from corpus import HELDOUT_SEED, generate_corpus  # noqa: E402

from minivllm.quantization.packing import write_quantized_checkpoint  # noqa: E402

work = Path(tempfile.mkdtemp())
write_quantized_checkpoint(DEFAULT_MODEL, work / "gptq", "gptq", group_size=32)
stories = generate_corpus(40, HELDOUT_SEED)
prompts = [" ".join(s.split()[:5]) for s in generate_corpus(16, HELDOUT_SEED + 1)]


def story_logprobs(llm) -> list[float]:
    """The logprob of every token of the held-out stories, each given the ones before it."""
    outs = llm.generate(stories, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [lp[t].logprob for o in outs for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]


greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
results, engines = {}, {}
for name, path, quantization, kv in (("float32", DEFAULT_MODEL, None, "auto"), ("int8", DEFAULT_MODEL, "int8", "auto"),
                                     ("GPTQ 4-bit g32", work / "gptq", None, "auto"),
                                     ("KV fp8 e4m3", DEFAULT_MODEL, None, "fp8_e4m3"),
                                     ("KV fp8 e5m2", DEFAULT_MODEL, None, "fp8_e5m2")):
    llm = engines[name] = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_dtype=kv,
                              num_kv_blocks=512)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]  # also a warm-up
    model = llm.engine.runner.model
    results[name] = dict(bytes=weight_bytes(model), layer_bytes=weight_bytes(model.model.layers), tokens=tokens,
                         logprobs=story_logprobs(llm), seconds=[])
# the speeds: one run on a busy machine decides nothing, so each engine runs three more times, the formats
# alternating (a burst of load elsewhere hits all alike), and the table shows the median
for _ in range(3):
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        results[name]["seconds"].append(time.perf_counter() - start)
del engines, llm
base = results["float32"]
print(f"{'format':15s} {'weights':>9s} {'(all/layers)':>12s} {'greedy agrees':>13s} {'perplexity':>10s} "
      f"{'max|dlogp|':>10s} {'tok/s':>6s}")
for name, r in results.items():
    r["agree"] = sum(a == b for x, y in zip(base["tokens"], r["tokens"]) for a, b in zip(x, y)) / (32 * len(prompts))
    r["ppl"] = math.exp(-sum(r["logprobs"]) / len(r["logprobs"]))
    r["max_dlogprob"] = max(abs(a - b) for a, b in zip(base["logprobs"], r["logprobs"]))
    r["tok_s"] = sum(map(len, r["tokens"])) / statistics.median(r["seconds"])
    print(f"{name:15s} {r['bytes'] / 2**20:5.2f} MiB {r['bytes'] / base['bytes']:5.0%}/"
          f"{r['layer_bytes'] / base['layer_bytes']:<6.0%} {r['agree']:13.1%} {r['ppl']:10.3f} "
          f"{r['max_dlogprob']:10.3f} {r['tok_s']:6.0f}")
speed = {name: results[name]["tok_s"] / base["tok_s"] for name in ("int8", "GPTQ 4-bit g32")}
print(f"speed against float32 (medians of 3 alternating runs): int8 {speed['int8']:.2f}x, "
      f"GPTQ {speed['GPTQ 4-bit g32']:.2f}x;")
print("  the quantized layers are slower here, as converting their weights on every call predicts"
      if max(speed.values()) < 1 else
      "  a quantized format is not slower here: at this size a step is mostly fixed per-operator costs, so\n"
      "  the conversion hides in the noise of this machine (a larger model shows it; see below)")
# int8 weights move about a quarter of the bytes, and fp8 caches keep most greedy tokens unchanged.
assert results["int8"]["layer_bytes"] <= 0.27 * base["layer_bytes"] and results["int8"]["bytes"] <= 0.35 * base["bytes"]
assert results["KV fp8 e4m3"]["agree"] >= 0.9 and results["KV fp8 e5m2"]["agree"] >= 0.85

# %% [markdown]
# The weights and the KV cache are quantized for different reasons, and the table shows it: int8 and 4-bit
# shrink the weights (the fp8 rows keep them whole), an fp8 cache shrinks what each token of context costs.
# What it buys, measured by the engine's own sizing: the same KV budget, in blocks, for the cache in the
# model's dtype on this machine and in fp8.

# %%
budget_bytes = 4 * 2**20
print(f"the same KV budget, {budget_bytes >> 20} MiB, in each cache dtype:")
for kv in ("auto", "fp8", "fp8_e5m2"):
    llm = LLM(kv_cache_dtype=kv, kv_cache_memory_bytes=budget_bytes, max_num_seqs=64)
    runner = llm.engine.runner
    results[f"blocks {kv}"] = runner.num_blocks
    print(f"kv_cache_dtype={kv!r:11s} {str(runner.kv_cache.dtype):20s} {runner.kv_cache.element_size()} "
          f"byte(s) an element: {runner.num_blocks:4d} blocks of {runner.config.block_size} tokens")
# In the engine, the same budget gives about twice as many blocks in fp8.
assert results["blocks fp8"] >= 1.9 * results["blocks auto"]

# %% [markdown]
# The fp8 caches hold two (against fp16 or bf16) or four (against fp32) times the blocks, and the first table
# shows what that costs on this model: greedy agreement and perplexity next to the float model's, the
# largest logprob change of any story token small; e4m3 (3 mantissa bits) closer than e5m2 (2 bits), whose
# wider range a cache with sensible scales does not need. Each layer's K and V are stored as fp8(x / scale)
# with one scale per tensor: 1.0 here, or the `k_scale` / `v_scale` a checkpoint ships (vLLM's convention).
# The torch backend upcasts what it reads and multiplies by the scale; the Triton kernels read the bytes and
# convert them with shifts (`minivllm/kernels/fp8.py`), which every GPU can do, a T4 included.
#
# Back to the weights: int8 keeps a quarter of the decoder layers' fp32 bytes and about a third of the whole model's
# (the embedding stays float: at this size it is a tenth of the model). These are the formats' bytes, and what the
# engine holds: on a CPU a float weight is held in the layout its matmul reads fastest *instead of* the checkpoint's
# (`minivllm/quantization/cpu_unquantized.py`; `held_bytes` counts everything). int8 changes nothing visible:
# per-channel scales lose at most half a step of 1/127 of each row's largest weight. 4-bit is an eighth of fp32 per
# linear weight (plus a scale and a zero point per group of 32) and costs more, though not where one might look first:
# the perplexity of held-out stories barely moves (this model finds its stories very predictable), but greedy
# continuations leave the float model's at a few positions (and, once they differ, go their own way). With groups of
# 128, as most Hub checkpoints use, agreement drops further (84% against 97% when this chapter was written). Real GPTQ
# and AWQ checkpoints do better than our plain rounding: they choose each q to minimise the layer's *output* error on
# calibration data (GPTQ), or rescale the input channels that matter most before rounding (AWQ).
#
# Speed is another matter. In fp32 (this chapter's setting, for an exact comparison) the quantized layers
# convert their weights back to float on every call, so they do more work than a float layer (the line
# under the table says whether that showed on this run: on a model this small a step is mostly fixed
# per-operator costs, which can hide it). On a GPU, reading half
# a byte per weight instead of two is what makes decoding faster: the Triton kernels
# (`minivllm/kernels/int8_linear.py`, `int4_linear.py`) convert each tile in registers. On a CPU in bf16
# torch's own int8 and int4 kernels run, and `bench/quant_throughput.py` measures a larger model: see
# `bench/RESULTS.md` for whether they beat oneDNN's bf16 matmul on the machine at hand.
#
# ## Inside a 4-bit word
#
# GPTQ packs eight 4-bit values into each int32 of `qweight` [K/8, N], *down the inputs*: input `k` of
# output column `n` is nibble `k % 8` of word `qweight[k // 8, n]`. Unpacking is a shift and a mask:
# `q = (word >> 4 * (k % 8)) & 0xF`, and then `w = (q - zero) * scale` with the zero point and scale of
# that input's group. AWQ packs across the outputs instead, and in the order 0, 2, 4, 6, 1, 3, 5, 7
# (its CUDA kernel converts pairs of nibbles with bit tricks). Below: one real word from the checkpoint
# just written, its 32 bits, and the eight weights it holds.

# %%
from safetensors import safe_open  # noqa: E402

from minivllm.quantization.int4 import unpack_cols  # noqa: E402

with safe_open(work / "gptq" / "model.safetensors", "pt") as f:
    qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
    qzeros = f.get_tensor("model.layers.0.mlp.down_proj.qzeros")
    scales = f.get_tensor("model.layers.0.mlp.down_proj.scales")
word = int(qweight[0, 0]) & 0xFFFFFFFF
nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
zero = int(unpack_cols(qzeros)[0, 0]) + 1  # GPTQ v1 stores zero - 1
weights = [(q - zero) * float(scales[0, 0]) for q in nibbles]
print(f"qweight[0, 0] = 0x{word:08X}; nibbles (inputs 0..7 of output 0) = {nibbles}")
print(f"zero point {zero}, scale {float(scales[0, 0]):.5f}")
print("weights:", [round(w, 4) for w in weights])

fig = Figure(figsize=(12, 2.6))
ax = fig.subplots()
colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
for bit in range(32):
    nib = bit // 4
    x = 31 - bit  # the most significant bit on the left, as the word is written
    ax.add_patch(Rectangle((x, 1), 1, 1, color=colors[nib], alpha=0.35))
    ax.text(x + 0.5, 1.5, str((word >> bit) & 1), ha="center", va="center", fontsize=9)
for nib in range(8):
    x = 32 - 4 * (nib + 1)
    ax.text(x + 2, 0.55, f"input {nib}\nq={nibbles[nib]}", ha="center", va="center", fontsize=8, color=colors[nib])
    ax.text(x + 2, -0.25, f"w={weights[nib]:+.3f}", ha="center", va="center", fontsize=8)
ax.set_xlim(0, 32)
ax.set_ylim(-0.6, 2.1)
ax.axis("off")
ax.set_title(f"GPTQ qweight[0, 0] = 0x{word:08X}: input k sits in bits 4k..4k+3, w = (q - {zero}) x scale")
widgets.show(fig)

# %% [markdown]
# The loader turns both layouts into one before the first step (`minivllm/quantization/int4.py`): on a
# CPU, the layout of torch's own int4 matmul (`_weight_int4pack_mm_for_cpu`, which wants
# `w = (q - 8) * s + (8 - z) * s`, the same numbers regrouped); on a GPU, GPTQ's words for the Triton
# kernel (`minivllm/kernels/int4_linear.py`), which shifts each tile's nibbles out in registers. The tests
# build GPTQ and AWQ checkpoints like the one above from a random Llama and check that greedy tokens equal
# transformers' on a float checkpoint holding exactly the dequantized weights (`tests/test_quantization.py`).

# %% [markdown]
# ## Exercise: int8 per-channel quantization
#
# Write `my_quantize(weight)`: `weight` is a float32 matrix `[N outputs, K inputs]`; return `(q, scale)` with
# `q` an int8 matrix of the same shape and `scale` one float per output channel (row), such that
# `weight ≈ q * scale[:, None]`, symmetric (no zero point) and using the full range: each row's largest
# `|w|` becomes ±127. Round to the nearest integer. A row of zeros must not turn into NaN.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your function into the real engine through its documented
# hook, `LLM(quantization="int8", hooks=EngineHooks(int8_quantize=...))` (`minivllm.hooks`; nothing is
# patched): every linear layer of the embedded model is quantized by your code as it loads, and the greedy
# tokens must equal those of the engine's own int8. Before that it checks a matrix with a known answer and
# properties on random ones. The reference solution is `chapters/solutions/ch12_int8_quantize.py`: try first.

# %%
def my_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch12 import check_int8_quantize  # noqa: E402

check_int8_quantize(my_quantize)


# %% [markdown]
# Next: [13 · Tensor parallelism: one model over several processes](13_tensor_parallelism.ipynb).
