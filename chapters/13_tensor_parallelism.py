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
# # 13 · Tensor parallelism
#
# A 70B model in bf16 is 140 GB of weights: no single GPU holds it. vLLM's answer inside one machine is
# **tensor parallelism**, `LLM(model, tensor_parallel_size=N)`: every layer's weights are cut into N pieces,
# one per GPU, and the GPUs compute each layer together, adding up their partial results with a collective
# (an **all-reduce**) twice per layer. The cut follows Megatron-LM
# ([Shoeybi et al., 2019](https://arxiv.org/abs/1909.08053)): split the first matmul of a block by its
# outputs and the second by its inputs, and the only communication left is one sum at the end of the block.
#
# minivllm does the same with `torch.distributed` (gloo on a CPU, NCCL on GPUs, one code path;
# `minivllm/distributed/`). This process is rank 0: it alone runs the scheduler, the block pool and the
# output side; it spawns N-1 worker processes, and each step broadcasts the scheduler's decisions to them.
# This chapter runs the embedded model on 2 ranks of this machine's CPU and looks at: how each weight is
# split (drawn from the real shards), what the all-reduces carry per token (computed from the config, then
# counted on the process group), the KV cache each rank holds, the step time with 1 and 2 ranks (measured
# here; computed for GPUs with NVLink), and whether 2 ranks write the same tokens as 1. It ends with an
# exercise: the rows of the fused q/k/v weight one rank holds.

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
import tempfile
import time

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from transformers import LlamaConfig

from minivllm import LLM, SamplingParams, widgets
from minivllm.config import DEFAULT_MODEL
from minivllm.core.kv_sizing import kv_bytes_per_token
from minivllm.distributed.parallel import TensorParallel, local_kv_heads
from minivllm.model import read_model_config
from minivllm.model.embedding import VocabParallelEmbedding
from minivllm.model.linear import ColumnLinear, RowLinear
from minivllm.quantization.sizing import model_weight_bytes
from minivllm.quantization.unquantized import UnquantizedLinearMethod, plain_weight

# %% [markdown]
# ## One rank and two
#
# Two engines on the embedded model: one process, and two ranks. `LLM(..., tensor_parallel_size=2)` starts
# a worker process (the `spawn` start method: a fresh Python interpreter that imports minivllm and loads its
# half of the weights), meets it on a TCP rendezvous at a port the OS picks, and checks that the model
# splits: heads, KV heads and the MLP width must divide by the ranks (a `ValueError` naming
# `tensor_parallel_size` otherwise). Both run on the CPU, also on a GPU machine: 2 ranks on CUDA need 2
# GPUs (one per rank, NCCL between them), and Colab gives one; on a machine with two, drop `device="cpu"`.
# The dtype is the engine's "auto": float32 or bf16, depending on the CPU (or on `MINIVLLM_CPU_DTYPE`).

# %%
one = LLM(DEFAULT_MODEL, device="cpu", num_kv_blocks=256)
start = time.perf_counter()
two = LLM(DEFAULT_MODEL, device="cpu", tensor_parallel_size=2, num_kv_blocks=256)
print(f"2 ranks ready in {time.perf_counter() - start:.1f} s (worker pid {two.engine.runner.workers.procs[0].pid})")
DTYPE = two.engine.config.dtype
mc = two.engine.config.model_config
print(f"dtype {DTYPE}; {mc.num_layers} layers, hidden {mc.hidden_size}, {mc.num_heads} heads and "
      f"{mc.num_kv_heads} KV heads of {mc.head_dim}, MLP width {mc.intermediate_size}, vocabulary {mc.vocab_size}")

# %% [markdown]
# ## How each weight is split
#
# Each linear layer of the decoder is one of two kinds (`minivllm/model/linear.py`). A **column-parallel**
# layer (`ColumnLinear`) splits its weight `W [outputs, inputs]` by rows: each rank computes some of the
# outputs from the whole input. q/k/v is one (each rank gets whole attention heads, so attention itself
# needs no communication), and so is the MLP's gate/up. A **row-parallel** layer (`RowLinear`) splits `W` by
# columns: each rank holds some of the inputs, which is exactly what the column layer before it left there
# (the heads' outputs for o_proj, the MLP's activations for down_proj), computes a partial `x_r @ W_r.T`,
# and one all-reduce adds the ranks' partial sums. The embedding and the LM head are split by vocabulary
# rows (`VocabParallelEmbedding`).
#
# Which rank holds which rows or columns is decided where the weights load: each layer's `weight_loader`
# cuts its rank's slice out of the checkpoint tensor. To draw it, the cell below builds each layer for
# rank 0 and for rank 1 (`TensorParallel(rank, 2)`: the rank and the size are all loading needs) and loads
# a full-size "weight" whose every element holds its own position; what each rank keeps says where its
# slice came from. The shapes are the embedded model's; the table compares them with rank 0's real model.

# %%
H, MLP, V, HD = mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.head_dim
Q, KV = mc.num_heads * HD, mc.num_kv_heads * HD
LAYERS = {  # name: (class, inputs, fused outputs); the full model's shapes
    "q/k/v": (ColumnLinear, H, [Q, KV, KV]),
    "o_proj": (RowLinear, Q, [H]),
    "gate/up": (ColumnLinear, H, [MLP, MLP]),
    "down_proj": (RowLinear, MLP, [H]),
}


def held(name: str, rank: int, size: int = 2) -> torch.Tensor:
    """A [outputs, inputs] map of the full weight: True where `rank` holds the element, as the engine loads it.
    Element (i, j) is loaded as the number 1 + i * inputs + j (0 is the padding of the vocabulary's last shard)."""
    tp = TensorParallel(rank, size)
    cls, inputs, outputs = LAYERS.get(name, (VocabParallelEmbedding, H, [V]))
    shape = (sum(outputs), inputs)
    ids = torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.float32).view(shape)
    if cls is VocabParallelEmbedding:
        layer = VocabParallelEmbedding(V, H, tp)
        layer.weight_loader(ids)
    else:
        layer, start = cls(inputs, outputs, False, method=UnquantizedLinearMethod(), tp=tp), 0
        for shard, rows in enumerate(outputs):
            layer.weight_loader("weight", ids[start : start + rows], shard if len(outputs) > 1 else None)
            start += rows
    kept = layer.weight.flatten().long()
    mask = torch.zeros(shape[0] * shape[1] + 1, dtype=torch.bool)
    mask[kept] = True
    return mask[1:].view(shape)


rank0_model = two.engine.runner.model.model
one_model = one.engine.runner.model.model
real = {"q/k/v": lambda m: plain_weight(m.layers[0].self_attn.qkv_proj),  # whatever layout the platform
        "o_proj": lambda m: plain_weight(m.layers[0].self_attn.o_proj),  # holds them in
        "gate/up": lambda m: plain_weight(m.layers[0].mlp.gate_up_proj),
        "down_proj": lambda m: plain_weight(m.layers[0].mlp.down_proj),
        "embedding": lambda m: m.embed_tokens.table()}
maps = {name: (held(name, 0), held(name, 1)) for name in real}
print(f"{'weight':10s} {'1 rank':>12s} {'rank 0 of 2':>12s}  split along   held by both ranks")
for name, (r0, r1) in maps.items():
    full, mine = tuple(real[name](one_model).shape), tuple(real[name](rank0_model).shape)
    split = "rows (outputs)" if mine[0] < full[0] else "columns (inputs)"
    print(f"{name:10s} {str(full):>12s} {str(mine):>12s}  {split:16s} {int((r0 & r1).sum()):d} elements")
    assert int(r0.sum()) == mine[0] * mine[1] or name == "embedding"
    assert bool((r0 | r1).all()), f"{name}: every element of the full weight lives on some rank"

# %%
fig = Figure(figsize=(13, 4.6), layout="constrained")
axes = fig.subplots(1, len(maps), gridspec_kw={"width_ratios": [m[0].shape[1] for m in maps.values()]})
colors = ListedColormap(["#4c72b0", "#dd8452"])
fused = {"q/k/v": [("q", Q), ("k", KV), ("v", KV)], "gate/up": [("gate", MLP), ("up", MLP)]}
for ax, (name, (r0, _)) in zip(axes, maps.items()):
    owner = np.where(r0.numpy(), 0, 1)
    ax.imshow(owner, cmap=colors, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_title(f"{name}\n{tuple(r0.shape)}", fontsize=10)
    ax.set_xlabel("inputs")
    ax.set_yticks([])
    ax.set_xticks([])
    edge = 0
    for label, rows in fused.get(name, []):  # the fused shards, each split on its own
        if edge:
            ax.axhline(edge - 0.5, color="white", lw=2)
        ax.text(r0.shape[1] / 2, edge + rows / 4, label, color="white", ha="center", va="center", fontsize=11)
        edge += rows
axes[0].set_ylabel("outputs (rows of W)")
fig.suptitle("Which rank holds each weight element: rank 0 blue, rank 1 orange (layer 0; every layer alike)")
widgets.show(fig)

# %% [markdown]
# (Every panel is drawn at the same height; the titles give the real shapes.) q/k/v is split three times
# over: rank 0 holds the first half of the query heads *and* the first half of the KV heads, so each rank
# attends its own heads with its own K and V. gate/up likewise: each rank needs gate and up for the same MLP
# columns (silu(gate) * up is computed element by element). o_proj and down_proj are split by columns, the
# inputs the column layers left on each rank. The embedding is split by vocabulary rows; the LM head shares
# its weight (the embedded model ties them), so its logits come out split by vocabulary too and are
# all-gathered before sampling. With fewer KV heads than ranks (8 KV heads on 16 ranks, say), each KV head
# is copied onto `N / num_kv_heads` ranks instead of split.
#
# ## Two all-reduces per layer, and what they carry
#
# A decoder layer's attention ends in o_proj and its MLP in down_proj: each is row-parallel, so each ends
# in one all-reduce of a `[tokens, hidden]` tensor. The vocab-parallel embedding adds one more per step
# (each rank looks up only its own rows; the others read zero), and the logits of the rows that are sampled
# are all-gathered once. From the config, per token of the step:

# %%
itemsize = torch.tensor([], dtype=DTYPE).element_size()
per_all_reduce = H * itemsize
all_reduces = 2 * mc.num_layers + 1  # o_proj and down_proj in every layer, and the embedding
rows_per_rank = two.engine.runner.model.model.embed_tokens.rows
print(f"one all-reduce carries hidden x {itemsize} bytes = {per_all_reduce:,d} bytes per token")
print(f"per token: {2 * per_all_reduce:,d} bytes per layer; {all_reduces} all-reduces = "
      f"{all_reduces * per_all_reduce:,d} bytes for the whole model")
print(f"per sampled row: the logits all-gather gives {rows_per_rank} x {itemsize} = {rows_per_rank * itemsize:,d} "
      f"bytes from each rank")

# %% [markdown]
# Now counted. Each rank's `TensorParallel` keeps a tally of what its model hands to the collectives
# (`CollectiveTraffic` in `minivllm/distributed/parallel.py`); rank 0's is `llm.engine.runner.traffic`. The
# engine's own counters say how many tokens went through the model (prompt tokens computed, plus one per
# decode) and how many steps ran it. Four new prompts, 16 tokens each:

# %%
PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there",
           "Once upon a time there was a little dog named Max"]
greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
traffic = two.engine.runner.traffic
before = two.engine.stats()
traffic.reset()
outs_two = two.generate(PROMPTS, greedy, use_tqdm=False)
after = two.engine.stats()
tokens = sum(after[k] - before[k] for k in ("num_prefill_tokens_computed", "num_decode_tokens"))
steps = after["num_steps"] - before["num_steps"]
print(f"{steps} steps, {tokens} tokens through the model")
print(f"all-reduces: {traffic.all_reduce_calls} calls, {traffic.all_reduce_bytes:,d} bytes handed in by rank 0 "
      f"= {traffic.all_reduce_bytes / tokens:,.0f} per token")
print(f"all-gathers: {traffic.all_gather_calls} calls, {traffic.all_gather_bytes:,d} bytes")
# The traffic counters match the count from the prose: all-reduces per layer per step, one all-gather per step.
assert traffic.all_reduce_calls == steps * all_reduces
assert traffic.all_reduce_bytes == tokens * all_reduces * per_all_reduce
assert traffic.all_gather_calls == steps

# %% [markdown]
# The count matches the formula to the byte. Those are the tensors' sizes; what crosses the wire depends on
# the algorithm. A ring all-reduce (what NCCL usually runs) sends `2 (N - 1) / N` of the tensor from
# every rank: its size exactly for N = 2, nearly twice it for large N. For a real model the numbers grow
# with the hidden size: Llama-3-8B (hidden 4096, 32 layers) in bf16 moves 8 KiB per all-reduce per token,
# 65 all-reduces per token, about half a MiB per token per rank. A prefill of 2,000 tokens therefore moves
# about a GiB per rank, a decode step of 64 sequences 33 MiB.
#
# ## The KV cache per rank
#
# Each rank caches K and V for its own KV heads only, in blocks with the same ids on every rank: the
# scheduler and the block pool (rank 0's) hand out block ids as before, and every rank writes its heads into
# that block of its own cache. Rank 0's cache against the single process's, and both ranks' block counts
# (`rank_states()` asks each worker between steps):

# %%
print(f"1 rank:    KV cache {tuple(one.engine.runner.kv_cache.shape)}  "
      "[layers, K/V, blocks, block_size, KV heads, head_dim]")
print(f"2 ranks:   rank 0's {tuple(two.engine.runner.kv_cache.shape)}")
for ranks in (1, 2):
    per_token = kv_bytes_per_token(mc.num_layers, local_kv_heads(mc.num_kv_heads, ranks), mc.head_dim, itemsize)
    print(f"{ranks} rank(s): {per_token:,d} bytes of K and V per token of context on each rank")
states = two.engine.runner.rank_states()
print("blocks per rank:", [s["num_blocks"] for s in states])
# Each of the two ranks holds half of the KV heads, and both hold the same number of blocks.
assert two.engine.runner.kv_cache.shape[-2] * 2 == one.engine.runner.kv_cache.shape[-2]
assert len({s["num_blocks"] for s in states}) == 1

# %% [markdown]
# Half the KV heads, half the bytes per token: on GPUs the same memory holds twice the context per rank, a
# large part of why tensor parallelism raises throughput and not only capacity. Each rank sizes its cache
# from its own free memory; they agree on the smallest count (`TensorParallel.min_int`), so every block id
# exists everywhere. (Here `num_kv_blocks=256` fixes it.)
#
# ## Step time: 1 rank and 2 on this CPU
#
# Now the cost. The same decode-heavy workload on each engine (four requests, 48 tokens each); the step
# time is the wall time over the engine's steps. Two ranks on a CPU share its cores and its memory
# bandwidth: each rank runs half the matmuls with half the threads, and adds two all-reduces per layer
# through gloo's TCP loopback.

# %%
timed = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
step_ms = {}
for label, llm in (("1 rank", one), ("2 ranks", two)):
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    before = llm.engine.stats()["num_steps"]
    start = time.perf_counter()
    llm.generate(PROMPTS, timed, use_tqdm=False)
    seconds = time.perf_counter() - start
    step_ms[label] = 1000 * seconds / (llm.engine.stats()["num_steps"] - before)
load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
print(f"{os.cpu_count()} CPU cores, load average {load:.2f}")
for label, ms in step_ms.items():
    print(f"{label:8s} {ms:6.1f} ms per step")

# %% [markdown]
# On a CPU with a couple of cores two ranks are no faster, and usually slower: the model's matmuls were
# already using every core, and a tiny model's step is mostly fixed costs (Python, the scheduler, the
# broadcast of the step to the worker, 13 all-reduces of a few KiB through the kernel's TCP stack, each
# from tens to hundreds of microseconds depending on the load). `bench/tp_throughput.py` measures it
# properly; `bench/RESULTS.md` has the figures.
#
# ## What changes on GPUs with NVLink (computed, not measured)
#
# On GPUs each rank brings its own memory bandwidth, and a decode step is bound by reading the weights:
# 2 ranks read half the weights each, in parallel. What they pay is the all-reduces, over NVLink. Below, a
# decode step of Llama-3-8B in bf16 on 1 and 2 H100 SXM GPUs, **computed** from the model's bytes
# (`model_weight_bytes`, the engine's sizing code) with assumed figures: 3.35 TB/s of HBM, 450 GB/s per
# direction of NVLink, and 10 µs of fixed latency per small all-reduce. Real systems reach perhaps 70-80%
# of both bandwidths, and CUDA graphs and custom all-reduce kernels shave the latency; the shape of the
# result is the point, not the digits.

# %%
with tempfile.TemporaryDirectory() as d:
    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(d)
    llama3 = read_model_config(d)
HBM, NVLINK, LATENCY = 3.35e12, 450e9, 10e-6  # assumed: bytes/s, bytes/s per direction, s per all-reduce
weights = model_weight_bytes(llama3, "float", dtype_bytes=2)
print(f"Llama-3-8B bf16: {weights / 2**30:.1f} GiB of weights, {2 * llama3.num_layers + 1} all-reduces per step")
print(f"{'batch':>5s} {'1 GPU':>9s} {'2 GPUs: weights':>16s} {'+ all-reduce':>13s} {'= step':>9s} {'speed-up':>9s}")
for batch in (1, 64, 256):
    one_gpu = weights / HBM
    half = weights / 2 / HBM
    message = batch * llama3.hidden_size * 2  # bytes per all-reduce; for N = 2 a ring sends that much
    reduce = (2 * llama3.num_layers + 1) * (LATENCY + message / NVLINK)
    print(f"{batch:5d} {one_gpu * 1e3:7.2f} ms {half * 1e3:13.2f} ms {reduce * 1e3:10.2f} ms "
          f"{(half + reduce) * 1e3:6.2f} ms {one_gpu / (half + reduce):8.2f}x")

# %% [markdown]
# Computed, then: about 1.6x on 2 GPUs for one sequence, where the all-reduces are mostly latency (65 of
# them at 10 µs), and a little less for large batches, where their bytes start to count (a batch of 256
# moves 2 MiB per all-reduce). Not 2x: the weights' time is halved, the all-reduces' time is new. That is
# why tensor parallelism stays inside one machine: across nodes the same all-reduces would cross a
# network 10-50 times slower than NVLink, and vLLM splits the *layers* across nodes instead (pipeline
# parallelism). minivllm can run ranks on several machines with `torchrun` (README, "Tensor
# parallelism"), as a mechanism rather than a recommendation.
#
# ## Same tokens as one rank
#
# Splitting a matmul changes the order of its additions: each rank sums over its half of the inputs, then
# the all-reduce adds the two halves. In float32 that rounding is far below the gaps between the top
# logits, and the greedy tokens must be equal; the chapter asserts it. In bf16 a near-tie can fall the
# other way, so there it only counts the agreement (the tests check tp=2 and tp=3 against transformers in
# float32, `tests/test_tensor_parallel.py`).

# %%
outs_one = one.generate(PROMPTS, greedy, use_tqdm=False)
same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs_one, outs_two)]
agree = sum(x == y for a, b in zip(outs_one, outs_two) for x, y in zip(a.outputs[0].token_ids,
                                                                        b.outputs[0].token_ids))
print(f"dtype {DTYPE}: {sum(same)} of {len(same)} requests identical, {agree} of {16 * len(PROMPTS)} tokens")
for prompt, out in zip(PROMPTS, outs_two):
    print(f"{prompt!r} -> {out.outputs[0].text!r}")
if DTYPE == torch.float32:
    assert all(same), "in float32, 2 ranks write 1 rank's greedy tokens"
worker = two.engine.runner.workers.procs[0]
two.shutdown()  # the worker leaves (also on `del`, at exit, or with `with LLM(...) as llm:`)
print(f"worker exit code {worker.exitcode}")
# Shutting the engine down ends its worker process cleanly, with exit code 0.
assert worker.exitcode == 0

# %% [markdown]
# ## Exercise: the rows of q/k/v one rank holds
#
# Write `my_qkv_rows(num_heads, num_kv_heads, head_dim, tp_size, rank)`: the row indices, in order, of the
# fused q/k/v weight `[(num_heads + 2 * num_kv_heads) * head_dim, hidden]` (q's rows first, then k's, then
# v's; head h of q is rows `h * head_dim` to `(h + 1) * head_dim - 1`) that rank `rank` of `tp_size` holds.
# Every rank takes an equal run of consecutive query heads, and an equal run of KV heads from k and the
# same heads from v. When there are fewer KV heads than ranks, each KV head is replicated on
# `tp_size / num_kv_heads` neighbouring ranks (rank r then holds KV head `r // (tp_size / num_kv_heads)`).
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker asks the engine the same question: it builds the q/k/v layer
# (`ColumnLinear`) for each rank, loads a weight whose row i holds the number i through the layer's own
# `weight_loader`, and reads back the rows the rank kept. It compares on a case with a known answer, on every
# shape the engine accepts up to 8 ranks, and on the embedded model's real q/k/v weights as the engine's
# loader shards them for 2 ranks. The reference solution is `chapters/solutions/ch13_qkv_rows.py`: try first.

# %%
def my_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, rank: int) -> list[int]:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch13 import check_qkv_rows  # noqa: E402

check_qkv_rows(my_qkv_rows)


# %% [markdown]
# Next: [14 · Mixture of experts: watching the router](14_mixture_of_experts.ipynb).
