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
# # 02 · The KV cache: prefill, decode, and what a block costs
#
# Attention at position *t* needs the keys and values of every earlier position. Recomputing them for
# the whole sequence at each new token makes generation quadratic; keeping them makes each new token
# cost one position. That store is the **KV cache**. This chapter measures why it pays, then does the
# memory arithmetic: bytes per token, bytes per block, how many blocks fit, first for figures often quoted
# for real models (and where they are wrong), then for the model we actually loaded.

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
import inspect
import statistics
import tempfile
import time

import torch
from matplotlib.figure import Figure
from transformers import AutoModelForCausalLM, LlamaConfig

from minivllm import LLM, SamplingParams, widgets
from minivllm.core import kv_sizing
from minivllm.core.kv_sizing import kv_bytes_per_block, kv_bytes_per_token, num_blocks_for_budget
from minivllm.model.loader import read_model_config

llm = LLM()
engine, runner = llm.engine, llm.engine.runner
KiB, MiB, GiB = 2**10, 2**20, 2**30

# %% [markdown]
# ## Prefill and decode
#
# A request's first step is its **prefill**: every prompt token goes through the model in one pass, the
# keys and values of all of them are written to the cache, and the last position's logits give the first
# new token. Every later step is a **decode**: one token in, attending over everything cached. We run one
# longer prompt and read the trace. One run decides nothing on a busy machine, so the same request runs
# once to warm up and then five times more (its cached prefix dropped each time, so every run prefills
# the whole prompt); the comparison uses the medians.

# %%
story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
         "One day, she saw a big red ball in the park. She ran to the ball and kicked it very high. ") * 3
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
prefill_ms, decode_ms = [], []
for run in range(6):  # run 0 warms up; each run is one prefill then its decodes, so the two alternate
    llm.reset_prefix_cache()
    start = engine.num_steps
    out = llm.generate([story], greedy, use_tqdm=False)[0]
    steps = widgets.new_steps(engine, start)
    prefill, decodes = steps[0], steps[1:]
    assert prefill.scheduled[0].kind == "prefill" and prefill.scheduled[0].num_tokens == len(out.prompt_token_ids)
    assert all(t.scheduled[0].kind == "decode" and t.num_tokens == 1 for t in decodes)
    if run:
        prefill_ms.append(prefill.duration_s * 1e3)
        decode_ms.extend(t.duration_s * 1e3 for t in decodes)
n_prompt = len(out.prompt_token_ids)
prefill_median, decode_median = statistics.median(prefill_ms), statistics.median(decode_ms)
in_decodes = prefill_median / decode_median
print(f"prompt: {n_prompt} tokens; each run's first step: {[(e.kind, e.num_tokens) for e in prefill.scheduled]}")
print(f"prefill: median {prefill_median:.1f} ms over {len(prefill_ms)} runs")
print(f"decode:  median {decode_median:.1f} ms over {len(decode_ms)} steps of 1 token")
print(f"the prefill computed {n_prompt} positions in the time of {in_decodes:.0f} decode steps:\n"
      f"{n_prompt / in_decodes:.0f}x the positions per second of decoding one at a time"
      if in_decodes < n_prompt else
      f"the prefill took as long as {in_decodes:.0f} decode steps, more than its {n_prompt} positions: "
      f"something else held the CPU during the prefills; run the cell again")

# %% [markdown]
# The prefill computed all the prompt's positions in the time of far fewer single-token decode steps than
# it has positions (the last line above says how many): its work is parallel (one matrix multiply over
# all positions), while decode is one position per step, bound by reading the weights and the cache.
# (Timings are measured on this machine, so they vary; the medians of five runs keep one slow step from
# deciding the comparison.)
#
# ## Why caching pays: the same model with and without a cache
#
# Hugging Face `transformers` can generate with its KV cache switched off (`use_cache=False`): then every
# step feeds the *whole* sequence through the model again. We load the same checkpoint with
# `transformers` and time both ways on the same greedy generation.

# %%
device = runner.device
hf = AutoModelForCausalLM.from_pretrained(engine.config.model, dtype=torch.float32).to(device).eval()
prompt_ids = torch.tensor([out.prompt_token_ids[:16]], device=device)
N = 64
timings, tokens = {}, {}
hf.generate(prompt_ids, max_new_tokens=2, do_sample=False)  # warm-up, so neither timing pays for a cold start
for use_cache in (True, False):
    t0 = time.perf_counter()
    gen = hf.generate(prompt_ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, use_cache=use_cache)
    timings[use_cache], tokens[use_cache] = time.perf_counter() - t0, gen[0, 16:].tolist()
p = prompt_ids.shape[1]
positions = {True: p + N - 1, False: sum(p + i for i in range(N))}
for use_cache in (True, False):
    print(f"use_cache={use_cache!s:5}: {timings[use_cache]:.2f} s, {positions[use_cache]:5d} positions computed")
print(f"the cache saves {timings[False] / timings[True]:.1f}x time here, "
      f"{positions[False] / positions[True]:.0f}x positions")
# The cache is an optimisation only: with and without it, greedy decoding must give the same tokens.
assert tokens[True] == tokens[False], "the cache changes the cost, not the result"
# the times are printed, not asserted: they depend on the machine and on what else it is doing

# %% [markdown]
# The saving grows with length: without a cache, step *i* recomputes all *p + i* positions, so *N* new
# tokens cost about *pN + N²/2* positions instead of *p + N*. Our engine does what `use_cache=True` does:

# %%
start = engine.num_steps
ours = llm.generate({"prompt_token_ids": out.prompt_token_ids[:16]},
                    SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
run = widgets.new_steps(engine, start)
print("positions computed by minivllm:", sum(t.num_tokens for t in run))
# minivllm computes each position once, exactly what transformers computes with use_cache=True.
assert sum(t.num_tokens for t in run) == positions[True]
print("same tokens as transformers:", ours.outputs[0].token_ids == tokens[True])

# %% [markdown]
# ## What one token and one block cost
#
# Each layer stores a key and a value vector per KV head for every token. The engine's formula
# (`minivllm/core/kv_sizing.py`):

# %%
print(inspect.getsource(kv_sizing.kv_bytes_per_token))
print(inspect.getsource(kv_sizing.kv_bytes_per_block))

# %% [markdown]
# ### Two pictures of a block
#
# Many diagrams draw blocks per layer: three short prompts, each fitting in one block of 16 tokens, in a
# 4-layer model make **3 x 4 = 12 blocks**. vLLM (and `minivllm`) name a block once for *all* layers: block
# id *b* is one slot range of 16 tokens in every layer's K and V tensors. Same memory, counted
# differently: 3 block ids, each spanning the 4 layers. The engine's trace shows the 3 ids the seed
# prompts got:

# %%
seed_prompts = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
start = engine.num_steps
llm.generate(seed_prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
first = widgets.new_steps(engine, start)[0]
block_ids = [b for blocks in first.allocated.values() for b in blocks]
print("block ids allocated in the prefill step:", first.allocated)
diagram_layers = 4
print(f"a per-layer diagram's picture: {len(block_ids)} prompts x {diagram_layers} layers = "
      f"{len(block_ids) * diagram_layers} blocks")
print(f"our model has {runner.model_config.num_layers} layers: the same 3 ids are "
      f"{len(block_ids) * runner.model_config.num_layers} per-layer blocks")
# Each short prompt takes one block id, and an id spans every layer: a 4-layer diagram's 12 blocks are 3 ids.
assert len(block_ids) == 3 and len(block_ids) * diagram_layers == 12

# %% [markdown]
# In the cache tensor, `[layers, K/V, blocks, block_size, kv_heads, head_dim]`, block *b* is the slice
# `kv_cache[:, :, b]`: every layer, both K and V. Its size is exactly the formula's bytes per block:

# %%
cache = runner.kv_cache
one_block = cache[:, :, block_ids[0]]
print("cache tensor:", tuple(cache.shape), cache.dtype, " one block:", tuple(one_block.shape))
# One block of the real cache tensor is exactly the bytes the formula gives per block.
assert one_block.numel() * one_block.element_size() == runner.bytes_per_block

# %% [markdown]
# ## A startup log, recomputed
#
# vLLM logs the KV cache it sized at startup. Take a log reporting about **10.86 GiB** of KV cache giving
# **32350** GPU blocks and **11915** CPU (swap) blocks, with a write-up of it saying a block is "about
# 34 MB". Those block counts fit **TinyLlama-1.1B** in fp16
# (22 layers, 4 KV heads of 64 dims). We write TinyLlama's config (no weights needed), read it with the
# engine's own config reader, and apply the engine's formula.

# %%
def model_config_of(**hf_config):
    """The engine's view of a transformers config, read the way it reads a checkpoint's config.json."""
    with tempfile.TemporaryDirectory() as d:
        LlamaConfig(**hf_config).save_pretrained(d)
        return read_model_config(d)


tiny_llama = model_config_of(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, dtype="float16")
fp16 = tiny_llama.torch_dtype.itemsize
per_block = kv_bytes_per_block(tiny_llama.num_layers, 16, tiny_llama.num_kv_heads, tiny_llama.head_dim, fp16)
gpu_blocks = num_blocks_for_budget(int(10.86 * GiB), per_block)
swap_blocks = num_blocks_for_budget(4 * GiB, per_block)  # vLLM's default swap space: 4 GiB
print(f"TinyLlama: {tiny_llama.num_layers} layers, {tiny_llama.num_kv_heads} KV heads x {tiny_llama.head_dim}")
print(f"bytes per block: 2 x 22 x 16 x 4 x 64 x 2 = {per_block:,} = {per_block / KiB:.0f} KiB")
print(f"10.86 GiB / {per_block / KiB:.0f} KiB = {gpu_blocks} GPU blocks;  4 GiB / {per_block / KiB:.0f} KiB = "
      f"{swap_blocks} CPU blocks")
# The formula reproduces the vLLM log's own numbers: bytes per block, then GPU and CPU block counts.
assert per_block == 360_448 == 352 * KiB
assert gpu_blocks == 32350 and swap_blocks == 11915

# %%
claimed = 34e6  # "about 34 MB per block"
print(f"with 34 MB blocks, 10.86 GB would hold {10.86e9 / claimed:.0f} blocks "
      f"({10.86 * GiB / (34 * MiB):.0f} in binary units), not 32350")
print(f"34 MB is {claimed / per_block:.0f}x the formula's block; the log's own numbers agree with the formula")
# The claimed 34 MB per block would give about 319 blocks, far from the 32350 the log reports.
assert round(10.86e9 / claimed) == 319

# %% [markdown]
# ### Grouped-query attention: Llama-3-70B
#
# A figure often quoted puts Llama-3-70B's KV cache at 2 x 8192 x 80 x 2 bytes = 2.6 MB per token, about
# 10.5 GB for a 4K context. That multiplies by the full hidden size, as if every one of the 64 query heads had its
# own keys and values. Llama-3-70B uses grouped-query attention: 8 KV heads of 128 dims, shared by groups
# of 8 query heads.

# %%
llama70b = model_config_of(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, dtype="bfloat16")
quoted = 2 * 8192 * 80 * 2
gqa = kv_bytes_per_token(llama70b.num_layers, llama70b.num_kv_heads, llama70b.head_dim, llama70b.torch_dtype.itemsize)
print(f"quoted:  {quoted:,} bytes/token = {quoted / 1e6:.2f} MB; 4K tokens = {quoted * 4096 / 1e9:.1f} GB")
print(f"GQA:     {gqa:,} bytes/token = {gqa / 1e6:.2f} MB; 4K tokens = {gqa * 4096 / 1e9:.2f} GB")
print(f"ratio {quoted // gqa} = {llama70b.num_heads} query heads / {llama70b.num_kv_heads} KV heads")
# Grouped-query attention cuts Llama-70B's KV bytes per token by its 8 query heads per KV head.
assert gqa == 327_680 and quoted // gqa == 8 and round(gqa * 4096 / 1e9, 1) == 1.3

# %% [markdown]
# ## The same figures for the model we loaded
#
# The engine computed all of this when it loaded: `runner.bytes_per_block` from the model's config and
# the dtype it chose (printed below: bf16 on a CPU with native bf16, else float32, unless `MINIVLLM_CPU_DTYPE`
# says otherwise; bf16 or fp16 on a GPU),
# and `runner.num_blocks` from its memory
# budget. On CPU the budget is a fixed knob (`kv_cache_memory_bytes`, or vLLM's `VLLM_CPU_KVCACHE_SPACE` in GiB,
# else `kv_sizing.DEFAULT_CPU_KV_CACHE_BYTES`: `config.cpu_kv_cache_bytes`); on a GPU the engine
# measures what is left after the weights and a profiled forward pass. Either way it takes no more blocks
# than `max_num_seqs` sequences of `max_model_len` tokens could ever fill (`kv_sizing.max_useful_blocks`):
# on a GPU a model this small would otherwise claim 90% of the card for blocks it can never use.

# %%
mc, bs = runner.model_config, engine.config.block_size
dtype_bytes = runner.cache_dtype.itemsize  # the model's dtype, unless kv_cache_dtype="fp8" (chapter 12)
per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_bytes)
print(f"{engine.config.model.name}: {mc.num_layers} layers, {mc.num_kv_heads} KV heads x {mc.head_dim} dims, "
      f"{runner.cache_dtype} ({dtype_bytes} bytes)")
print(f"bytes per token: 2 x {mc.num_layers} x {mc.num_kv_heads} x {mc.head_dim} x {dtype_bytes} = {per_token:,}")
print(f"bytes per block: x {bs} tokens = {runner.bytes_per_block:,} = {runner.bytes_per_block / KiB:.0f} KiB")
print(f"blocks: {runner.num_blocks:,} = {runner.num_blocks * bs:,} tokens of KV cache "
      f"({cache.nbytes / MiB:.0f} MiB)")
# The engine sizes its blocks and its whole cache by the same formula we just applied.
assert runner.bytes_per_block == per_token * bs
assert cache.nbytes == runner.num_blocks * runner.bytes_per_block
if device.type == "cpu":
    budget = engine.config.cpu_kv_cache_bytes
    most = kv_sizing.max_useful_blocks(engine.config.max_num_seqs, mc.max_position_embeddings, bs)
    print(f"budget {budget / MiB:.0f} MiB holds {num_blocks_for_budget(budget, runner.bytes_per_block):,} blocks; "
          f"{engine.config.max_num_seqs} sequences of {mc.max_position_embeddings} tokens could use {most:,}")
    assert runner.num_blocks == min(num_blocks_for_budget(budget, runner.bytes_per_block), most)

# %% [markdown]
# ## Memory as land
#
# Think of the accelerator's memory as land to divide: the **weights** (fixed by the model), the **KV
# cache** (the engine takes most of what is left, in blocks), and **activations** and workspace for one
# step (plus memory outside torch's allocator). A 1.1B model in fp16 needs about 2.2 GB of weights; ours
# is tiny, so nearly all of its land is KV cache. The numbers below are read from the loaded engine: weight
# bytes from its parameters, KV bytes from the cache tensor. On a GPU the activation peak is measured by
# one forward pass at the full step budget (the same profiling the engine does when it sizes the cache).

# %%
weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
land = {"weights": weights, "KV cache": cache.nbytes}
if device.type == "cuda":
    # one forward pass of max_num_batched_tokens tokens: the same profiling the engine does at start-up
    land["activations (peak of one full step)"] = runner.profile_run()
    free, total = torch.cuda.mem_get_info()
    land["other / outside torch"] = total - free - torch.cuda.memory_allocated()
    land["free"] = free
for name, size in land.items():
    print(f"{name:38s} {size / MiB:10.1f} MiB")
if device.type == "cpu":
    print("(on CPU there is no device memory to profile: run on a GPU to see activations measured)")
fig = Figure(figsize=(9, 1.6))
ax = fig.add_subplot()
left = 0
for (name, size), color in zip(land.items(), ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#dddddd"]):
    ax.barh(0, size / MiB, left=left, color=color, label=f"{name} ({size / MiB:.0f} MiB)")
    left += size / MiB
ax.set_yticks([])
ax.set_xlabel("MiB")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=3, fontsize=8, frameon=False)
ax.set_title(f"{runner.device} memory used by the engine", fontsize=10)
widgets.show(fig)
# The weights are parameters times dtype bytes, and for this small model the KV cache outweighs them.
assert weights == sum(p.numel() for p in runner.model.parameters()) * dtype_bytes
assert land["KV cache"] > land["weights"], "for a small model, the KV cache is most of the land"


# %% [markdown]
# ## Exercise: decode attention one block at a time (the online softmax)
#
# A decoding query attends over a context scattered over blocks. A kernel does not gather it and take one
# softmax: it walks the block table, keeping per head a running maximum `m`, a running sum `l` of
# exp(score - m) and a running sum `acc` of exp(score - m) * value. When a block brings a larger score, what
# was summed so far is rescaled by exp(m_old - m_new). At the end `acc / l` is exactly softmax(q K) V.
# Write one block's update: `m`, `l` are `[heads]`, `acc` is `[heads, dim]`, `scores` (already scaled) is
# `[heads, n]` and `v` is `[heads, n, dim]`; the walk starts from m = -inf, l = 0, acc = 0.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(online_softmax_update=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch02_online_softmax.py`: try first.
#
# With your update set, the torch reference backend attends every decode step block by block through the
# paged cache (`minivllm/attention/online_softmax.py`, what each program of the Triton decode kernel does),
# and the checker compares the engine's greedy tokens with Hugging Face transformers.

# %%
import torch


def my_online_softmax_update(m, l, acc, scores, v):  # noqa: E741
    raise NotImplementedError  # your code here: return the new (m, l, acc)


# %%
from minivllm.exercises.ch02 import check_online_softmax_update

check_online_softmax_update(my_online_softmax_update)

# %% [markdown]
# Next: [03 · Paged blocks: block tables, the free queue, and how little paging wastes](03_paged_blocks.ipynb).
