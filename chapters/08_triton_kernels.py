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
# # 08 · Triton kernels: paged attention on the GPU
#
# The torch backend (`minivllm/attention/torch_backend.py`) gathers each request's K/V blocks into a
# contiguous tensor and calls one attention function: clear, and the oracle everything else is checked
# against, but it copies the whole context every step. The Triton kernels in `minivllm/kernels/` read the
# paged cache where it lies, walking the block table inside the kernel, and fuse scores, softmax and the
# weighted sum into one pass. This chapter reads the decode kernel, checks it against the reference, and,
# on a GPU, measures how close it gets to the memory bandwidth that bounds decode. (On CPU the cpu
# platform does the same in-place reading through a small C++ kernel, `minivllm/attention/cpu_attention.py`
# over `cpu_paged_attention.cpp`, compiled at first use; `MINIVLLM_PLATFORM=reference` keeps the gathering
# reference. The last sections show which platform runs which code.)
#
# Without a CUDA GPU, Triton can still run the kernels through its **interpreter** (numpy, one program
# at a time): slow, but the same code and exact in fp32. The interpreter is chosen when a kernel is
# defined, so `TRITON_INTERPRET=1` must be set before anything imports triton: that is the next cell.

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
import torch  # importing torch does not import triton

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton: kernels run on CPU tensors

import inspect
import math
import time

from IPython.display import HTML, display
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams, widgets
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import paged_attention_ref, paged_decode_ref
from minivllm.kernels import interpreted, paged_decode, paged_decode_attention, paged_prefill_attention

DEVICE = "cuda" if GPU else "cpu"
print(f"device: {torch.cuda.get_device_name() if GPU else 'CPU'}; Triton interpreter: {interpreted()}")
assert interpreted() == (not GPU), "restart the kernel: triton was imported before TRITON_INTERPRET was set"

# %% [markdown]
# ## The decode kernel
#
# Decode brings one new query per request, which must attend over the request's whole cached context.
# The module's docstring names the four ideas; the source follows.

# %%
source = inspect.getsource(paged_decode)
kernel_src = source[source.index("@triton.jit\ndef _paged_decode_kernel") : source.index("@triton.jit\ndef _split")]
print(paged_decode.__doc__)
print(kernel_src)

# %% [markdown]
# Read it in this order:
#
# * **the grid**: one program per (request `b`, kv head, split). All the query heads that share a kv head
#   (grouped-query attention: `QUERY_GROUP` of them) are rows of one `[BLOCK_G, BLOCK_D]` query tile, so
#   each K/V tile is loaded once for the whole group and used in one `tl.dot`;
# * **the block-table walk**: the context is read in tiles of `BLOCK_N` positions; for each position,
#   `block = table[pos // KV_BLOCK_SIZE]` is its physical block and `pos % KV_BLOCK_SIZE` its slot there,
#   so a tile may span several blocks or part of one, and physical blocks can be anywhere in the cache;
# * **online softmax**: the running max `m_i`, running sum `l_i` and unnormalised output `acc` are
#   rescaled by `alpha = exp2(m_old - m_new)` whenever a tile raises the max, so K/V are read once and
#   no `[heads, context]` score matrix is ever stored (`exp2` with `log2(e)` folded into the scale is the
#   GPU's native exponential);
# * **split-K**: with few requests, (request, kv head) programs alone leave most of the GPU idle, so each
#   context is also cut into `NUM_SPLITS` slices; each writes its partial `(m_i, l_i, acc)` and a small
#   reduce kernel merges them:

# %%
print(source[source.index("@triton.jit\ndef _split_reduce"):source.index("def choose_num_splits")])
print(inspect.getsource(paged_decode.choose_num_splits))

# %% [markdown]
# ## The online-softmax identity, numerically
#
# Attention over one context is `softmax(s) @ V` for scores `s`. Processed tile by tile, keep `m` (the
# max so far), `l` (the sum of `exp(s - m)`) and `acc` (the sum of `exp(s - m) * v`); when a tile brings a
# larger max, everything so far is multiplied by `exp(m_old - m_new)`. At the end `acc / l` is exactly the
# softmax-weighted sum. And two slices' partial results merge the same way, which is all the split-K
# reduce does. Here is the arithmetic on random numbers, in float64, against the direct formula.

# %%
gen = torch.Generator().manual_seed(0)
s = torch.randn(200, generator=gen, dtype=torch.float64) * 3
v = torch.randn(200, 8, generator=gen, dtype=torch.float64)
direct = torch.softmax(s, 0) @ v


def online(scores, values, tile=32):
    m, total, acc = -math.inf, 0.0, torch.zeros(values.shape[1], dtype=values.dtype)
    for i in range(0, len(scores), tile):
        st, vt = scores[i : i + tile], values[i : i + tile]
        m_new = max(m, st.max().item())
        alpha = math.exp(m - m_new)  # rescale what was accumulated under the old max
        p = torch.exp(st - m_new)
        total, acc, m = total * alpha + p.sum().item(), acc * alpha + p @ vt, m_new
    return m, total, acc  # m, l and acc of the kernel


m, total, acc = online(s, v)
parts = [online(s[:90], v[:90]), online(s[90:], v[90:])]  # two split-K slices
m_max = max(mp for mp, _, _ in parts)
weights = [math.exp(mp - m_max) for mp, _, _ in parts]  # each slice rescaled to the global max
merged = sum(w * ap for w, (_, _, ap) in zip(weights, parts)) / sum(w * lp for w, (_, lp, _) in zip(weights, parts))
print(f"tile by tile vs direct: max |error| {(acc / total - direct).abs().max():.1e}")
print(f"two slices merged vs direct: max |error| {(merged - direct).abs().max():.1e}")
assert torch.allclose(acc / total, direct, atol=1e-12) and torch.allclose(merged, direct, atol=1e-12)

# %% [markdown]
# ## The kernel against the reference, on small shapes
#
# A paged cache with deliberately awkward contents: 4 requests whose contexts (1, 19, 40 and 77 tokens)
# are not multiples of the block size (8), physical blocks shuffled across the cache, and grouped-query
# attention (8 query heads over 2 kv heads, head_dim 32). The reference is `paged_decode_ref`, the torch
# backend's decode path; we run the kernel without split-K and with 3 slices.


# %%
def paged_batch(query_lens, seq_lens, block_size=8, heads=8, kv_heads=2, head_dim=32, dtype=torch.float32,
                seed=0):
    """Random caches; each request owns shuffled physical blocks; its last query_len tokens are new."""
    torch.manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)  # made where it is used: GBs in the GPU timings
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for n in need:
        tables.append(perm[:n] + [0] * (max(need) - n))
        perm = perm[n:]
    q = torch.randn(sum(query_lens), heads, head_dim, dtype=dtype, device=DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).to(torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return q, k_cache, v_cache, meta


seq_lens = [1, 19, 40, 77]
q, k_cache, v_cache, meta = paged_batch([1] * 4, seq_lens)
scale = 32**-0.5
want = paged_decode_ref(q, k_cache, v_cache, meta, scale)
print("block tables:", meta.block_tables.tolist())
print(f"request 3, position 50 -> physical block {meta.block_tables[3, 50 // 8].item()}, slot {50 % 8}")
errors = {}
for splits in (1, 3):
    t0 = time.perf_counter()
    got = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=splits,
                                 block_n=16)
    errors[splits] = (got - want).abs().max().item()
    print(f"num_splits={splits}: max |kernel - reference| = {errors[splits]:.1e} "
          f"({(time.perf_counter() - t0) * 1e3:.0f} ms{' in the interpreter' if not GPU else ''})")
assert all(e < 2e-5 for e in errors.values())

# %% [markdown]
# The prefill kernel (`paged_prefill.py`) is the same walk for many queries per request, with a causal
# mask: FlashAttention over a paged cache. Like the decode kernel it loads each K/V tile once per kv head:
# a tile's rows are (query, query head) pairs, every head of the group for each of its queries. One mixed
# batch covers its cases: a fresh prompt, a prompt after a cached prefix, and a decode row.

# %%
q, k_cache, v_cache, meta = paged_batch([13, 5, 1], [13, 29, 40], seed=1)
got = paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                              meta.max_query_len, block_n=16)
err = (got - paged_attention_ref(q, k_cache, v_cache, meta, scale)).abs().max().item()
print(f"prefill: max |kernel - reference| = {err:.1e}")
assert err < 2e-5

# %% [markdown]
# ## The kernel's walk, drawn from its own run
#
# Now the kernel on the engine's own data: a real generation with the Triton backend, stopped after one
# decode step, whose layer-0 KV cache, block tables and context lengths we read from the engine (its
# scheduler's KV manager holds the tables, its runner the cache). With a query for every head we run the
# decode kernel on them once more, in Triton's interpreter, with 2 split-K slices and 16-position tiles.
# `minivllm/kernels/program_log.py` logs two things as the kernel's Python body executes: every load
# (the block-table loads say which physical blocks a tile reads) and every float `maximum` (the last one
# in a tile is `m_new`, the running max). The interpreter runs the program instances one by one and says
# which is running (`grid_idx`), so each record belongs to a (request, kv head, split). Nothing in the
# figure is recomputed outside the kernel. On a GPU the compiled kernel cannot be logged, so the log comes
# from the interpreter on CPU copies (in a child Python: the interpreter is chosen as triton is imported),
# and the compiled kernel runs on the same inputs, is compared, and is timed with and without the split.

# %%
from minivllm.kernels.program_log import run_logged

print(inspect.getsource(run_logged))
walk_llm = LLM(attention_backend="triton", dtype="float32", block_size=8, num_kv_blocks=32, trace_steps=0)
walk_engine = walk_llm.engine
story = ("Once upon a time there was a little dog named Max who liked to run in the park with his friends "
         "every morning, before the sun came up over the hills behind the old town.")
for i, prompt in enumerate([story, "Hello there, how are you today?"]):
    walk_engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
walk_engine.step()  # prefill
walk_engine.step()  # one decode step
running = walk_engine.scheduler.running
tables = [list(walk_engine.scheduler.kv.block_tables[s.request_id]) for s in running]
block_tables = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
seq_lens = torch.tensor([s.num_computed_tokens for s in running], dtype=torch.int32)  # tokens in the cache
k_cache, v_cache = (c.cpu() for c in walk_engine.runner.kv_cache[0])  # layer 0
heads, head_dim = walk_engine.config.model_config.num_heads, k_cache.shape[3]
q = torch.randn(len(running), heads, head_dim, generator=torch.Generator().manual_seed(0))
scale = head_dim**-0.5
log = run_logged(paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=2,
                 block_n=16)
walk = widgets.decode_walk(log)
print("the engine's block tables:", block_tables.tolist(), " context lengths:", seq_lens.tolist())
meta = AttentionMetadata(
    slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=block_tables, seq_lens=seq_lens,
    query_start_loc=torch.arange(len(running) + 1, dtype=torch.int32), max_query_len=1,
    max_seq_len=int(seq_lens.max()), query_lens_cpu=[1] * len(running), seq_lens_cpu=seq_lens.tolist())
want = paged_decode_ref(q, k_cache, v_cache, meta, scale)
print(f"interpreted, 2 slices vs the reference: max |difference| {(log.result - want).abs().max():.1e}")
assert torch.allclose(log.result, want, atol=1e-5)
args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a
             for a in (q, k_cache, v_cache, block_tables, seq_lens, scale))
if GPU:
    compiled = paged_decode_attention(*args, num_splits=2, block_n=16).cpu()
    print(f"compiled on the GPU vs interpreted: max |difference| {(compiled - log.result).abs().max():.1e}")
    assert torch.allclose(compiled, log.result, atol=1e-5)
read = {b: sorted({blk for s in range(2) for t in walk.get((b, 0, s), []) for blk in t.blocks})
        for b in range(len(running))}
assert all(read[b] == block_tables[b, : -(-int(n) // 8)].tolist() for b, n in enumerate(seq_lens)), read
widgets.show(widgets.kernel_walk_figure(walk, group=heads // k_cache.shape[2]))

# %% [markdown]
# Read it request by request. Each coloured band is one tile of 16 positions, two 8-token KV blocks of the
# engine's cache (the labels are physical block ids, looked up in the block table as the kernel ran); its
# colour is the split, i.e. the program instance, that read it. The lines are the running max `m_i` of
# each query head sharing kv head 0, after each tile: it only ever rises within a slice, and it starts
# again in the second slice, which began from `-inf` in a separate program; the reduce kernel then
# rescales both slices to the larger max. The short request's context fits one tile, so its second slice
# is empty and draws nothing. On a GPU, the compiled kernel on the same inputs, timed:

# %%
if GPU:
    from minivllm.kernels.timing import time_ms

    for splits in (1, 2):
        ms = time_ms(lambda splits=splits: paged_decode_attention(*args, num_splits=splits))
        print(f"num_splits={splits}: {ms * 1e3:.1f} us on {torch.cuda.get_device_name()}")
else:
    print("No CUDA GPU here: the figure above came from the interpreter; there is no kernel time to show.")

# %% [markdown]
# ## On a GPU: achieved bandwidth
#
# Decode is memory bound: each step reads every cached K/V byte of every request once and does only a
# few operations per byte. So the kernel's figure of merit is bandwidth: K/V bytes read per second,
# against what a plain device-to-device copy reaches on the same GPU (a practical ceiling). This cell
# times the compiled kernel with CUDA events over batch sizes at a 2048-token context (32 query heads,
# 8 kv heads, head_dim 128, bf16 or fp16: a Llama-3-8B-like layer). Without a GPU there is nothing
# honest to time, and the cell says so.


# %%
from minivllm.kernels.timing import copy_bandwidth, time_ms

if GPU:
    half = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16  # T4 (sm75): fp16
    copy_bw = copy_bandwidth(1 << 30)  # bytes read + written per second by a plain device-to-device copy
    context, measured = 2048, []
    for batch in (1, 4, 16, 64, 128):
        q, k_cache, v_cache, meta = paged_batch([1] * batch, [context] * batch, block_size=16, heads=32,
                                                kv_heads=8, head_dim=128, dtype=half)
        args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 128**-0.5)
        ms = time_ms(lambda args=args: paged_decode_attention(*args, max_seq_len=context))
        kv_bytes = 2 * batch * context * 8 * 128 * k_cache.element_size()
        measured.append((batch, ms, kv_bytes / (ms * 1e-3)))
        print(f"batch {batch:3d} x {context} tokens: {ms * 1e3:7.1f} us, {kv_bytes / (ms * 1e-3) / 1e9:6.0f} GB/s "
              f"= {kv_bytes / (ms * 1e-3) / copy_bw:.0%} of copy bandwidth ({copy_bw / 1e9:.0f} GB/s)")
        del q, k_cache, v_cache, meta, args
    fig = Figure(figsize=(6, 3))
    ax = fig.add_subplot()
    ax.plot([b for b, _, _ in measured], [bw / 1e9 for _, _, bw in measured], "o-", label="paged decode kernel")
    ax.axhline(copy_bw / 1e9, color="black", linestyle="--", label="device-to-device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests decoding, 2048-token contexts)")
    ax.set_ylabel("GB/s of K/V read")
    ax.set_title(torch.cuda.get_device_name(), fontsize=9)
    ax.legend(fontsize=8)
    widgets.show(fig)
    assert all(bw < 1.2 * copy_bw for _, _, bw in measured)
else:
    print("No CUDA GPU here: the bandwidth plot is skipped. The interpreter's timings say nothing about a GPU's; "
          "run this notebook on a GPU runtime (Colab: Runtime > Change runtime type) to measure them.")

# %% [markdown]
# ## Fused elementwise kernels: many small launches become one
#
# Attention is not the only thing a decode step launches. In torch, `RMSNorm(x + residual)` is a chain of
# small operations, each a kernel that reads and writes the whole activation; the rotary embedding is
# another chain. For a decode batch these kernels are tiny, so their cost is mostly their launch. The
# Triton backend replaces each chain with one kernel. Below, a torch dispatch mode counts the operations
# the torch code runs (each one a kernel launch on a GPU), and the fused kernel is checked against it.

# %%
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.kernels import norm as norm_kernels
from minivllm.kernels import rms_norm
from minivllm.model.llama import RMSNorm

print(inspect.getsource(norm_kernels._rms_norm_kernel.fn))


class CountOps(TorchDispatchMode):
    """Records every aten operation torch runs while the mode is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


hidden = 256
norm = RMSNorm(hidden, 1e-6).to(DEVICE)
x, residual = torch.randn(8, hidden, device=DEVICE), torch.randn(8, hidden, device=DEVICE)
with CountOps() as counted:
    want, want_residual = norm(x, residual)
got, got_residual = rms_norm(x, norm.weight, norm.eps, residual)
print(f"torch add + RMSNorm: {len(counted.ops)} operations {counted.ops}; the fused kernel: 1 launch")
err = max((got - want).abs().max().item(), (got_residual - want_residual).abs().max().item())
print(f"max |fused - torch| = {err:.1e}")
assert err < 1e-4 and len(counted.ops) > 5  # fp32; a GPU's rsqrt is an approximation

# %% [markdown]
# ## The whole engine on the Triton backend
#
# `attention_backend="triton"` runs every attention layer through these kernels (store K/V, then the
# decode kernel when every request brings one token, the prefill kernel otherwise), and swaps three chains
# of small torch operations for one kernel each: RMSNorm with the residual add before it
# (`minivllm/kernels/norm.py`), the rotary embedding of q and k (`minivllm/kernels/rotary.py`) and the
# MLP's silu(gate) * up (`minivllm/kernels/activation.py`).
# Greedy outputs must equal the torch backend's on the embedded model. On CPU the interpreter makes this
# slow, so two short prompts and 8 tokens; both in float32, so the comparison is of the algorithm, not of
# rounding.

# %%
prompts = ["Hi, my name is", "Hello there"]
params = SamplingParams(temperature=0, max_tokens=8)
results = {}
for backend in ("torch", "triton"):
    llm = LLM(attention_backend=backend, dtype="float32", num_kv_blocks=64)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    results[backend] = [o.outputs[0].token_ids for o in outs]
    platform = llm.llm_engine.runner.platform.name
    print(f"{backend:6s} on the {platform} platform ({time.perf_counter() - t0:5.2f} s): "
          f"{[o.outputs[0].text for o in outs]}")
assert results["triton"] == results["torch"], "the kernels change where attention runs, not what it computes"

# %% [markdown]
# ## Platforms: which code serves each op
#
# Those two runs differ in one argument, yet nothing in the model's code changed between them. Every
# choice of implementation is made once, when the engine is built: `choose_platform`
# (`minivllm/platforms/__init__.py`) picks a **platform** from the device, the dtype,
# `attention_backend` and the `MINIVLLM_PLATFORM` variable, and the model is built from what it
# supplies. `minivllm/model/llama.py` names no hardware. There are three:
#
# * `reference`: plain torch everywhere, the code the chapters print, and the oracle;
# * `cpu`: C++ ops compiled at first use: attention reading the paged cache in place, fused norm,
#   rotary and SwiGLU, float weights held once in a tiled layout that decode steps stream, and each
#   decoder layer's ops bound into one function for decode steps (the `decoder_layer` row), a C++ op
#   that calls the kernels directly where its matmuls are the tiled or GGUF ones;
# * `cuda`: this chapter's Triton kernels, and CUDA graphs on a real GPU.
#
# The table below is read from the platform objects themselves (`Platform.op_table()`), and each
# fast path names the test that runs it against the reference (`Platform.tested_by`).

# %%
from minivllm.platforms import ReferencePlatform, choose_platform
from minivllm.platforms.cuda import CudaPlatform

dtype = torch.float32
platforms = [ReferencePlatform(DEVICE, dtype), CudaPlatform(DEVICE, dtype)]
if not GPU:  # the C++ platform is the CPU's
    platforms.insert(1, choose_platform("cpu", dtype))
tables = [p.op_table() for p in platforms]
rows = "".join(
    f"<tr><td><b>{op}</b></td>" + "".join(
        f"<td>{t[op].removeprefix('minivllm.')}"
        + (f"<br><i>{p.tested_by.get(op, '')}</i>" if t[op] != tables[0][op] else "") + "</td>"
        for p, t in zip(platforms, tables)) + "</tr>"
    for op in tables[0] if not op.endswith(".layout"))
head = "".join(f"<th>{p.name}</th>" for p in platforms)
display(HTML(f"<table><tr><th>op</th>{head}</tr>{rows}</table>"))

# %% [markdown]
# ## CUDA graphs: one launch per decode step
#
# Fast kernels are not enough for a small model. A decode step of the embedded model is about a hundred
# kernel launches, each finishing in a few microseconds, and the host takes longer to issue them than the
# GPU takes to run them. A **CUDA graph** records a step's launches once and replays them as one unit
# (`minivllm/runner/cuda_graphs.py`). A replay repeats the recording exactly, which sets three rules:
#
# * the same tensors: each step's inputs are copied into **static buffers**, and the output is read from
#   the buffer the graph writes;
# * the same shapes: one graph per batch size below; a batch is **padded** up to the next size, and each
#   padding row stores nothing (slot -1) and attends to one token. Prefill and mixed steps, whose shapes
#   change every step, run eagerly, as does any batch above the largest size;
# * the same launch parameters: the decode kernel's split-K count is fixed per size.

# %%
from minivllm.runner.cuda_graphs import DecodeGraphs, capture_sizes

print("graphs are captured for decode batches of", capture_sizes(256))

# %% [markdown]
# Recording needs CUDA, but everything around it (buffers, copies, padding) runs anywhere with
# `capture=False`, which executes the padded batch eagerly. Here three requests decode together, so the
# batch is padded to 4: the table shows the buffers the step read, the grey column is the padding.

# %%
llm = LLM(dtype="float32", num_kv_blocks=64, attention_backend="torch")
runner, engine = llm.engine.runner, llm.engine
graphs = DecodeGraphs(runner.model, runner.kv_cache, [1, 2, 4, 8], -(-engine.config.max_model_len // 16),
                      runner.device, num_splits=lambda size: 1, capture=False)
runner.graphs = graphs
greedy = SamplingParams(temperature=0, max_tokens=4)
for i, prompt in enumerate(["Once upon a time", "The cat", "Hello"]):
    engine.add_request(f"r{i}", prompt, greedy)
engine.step()  # the three prompts' prefill: an eager step
engine.step()  # the first decode step: 3 requests, padded to a graph of 4
display(HTML(widgets.graph_batch_html(graphs)))
assert graphs.last_replay == (3, 4)
assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 1, "row 4 is padding"
finished = {}
while engine.has_unfinished_requests():
    finished.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
plain = LLM(dtype="float32", num_kv_blocks=64, attention_backend="torch").generate(
    ["Once upon a time", "The cat", "Hello"], greedy, use_tqdm=False)  # no graph path: plain eager steps
print("through the padded buffers:", [finished[f"r{i}"].text for i in range(3)])
print("plain eager steps:         ", [o.outputs[0].text for o in plain])
assert [finished[f"r{i}"].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in plain]

# %% [markdown]
# On a GPU the engine captures graphs by itself (Triton backend, unless `enforce_eager=True`). This cell
# times the same decode-heavy run both ways on the embedded model, where launches dominate.

# %%
if GPU:
    timings = {}
    for eager in (True, False):
        gpu_llm = LLM(enforce_eager=eager, trace_steps=0)
        work = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (8, 16, 24, 32)] * 8
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        gpu_llm.generate(work[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpu_llm.generate(work, params, use_tqdm=False)
        timings["eager" if eager else "CUDA graphs"] = time.perf_counter() - t0
        del gpu_llm
    for name, seconds in timings.items():
        print(f"{name:12s}: {32 * 128 / seconds:8.0f} output tok/s")
    print(f"CUDA graphs: {timings['eager'] / timings['CUDA graphs']:.1f}x on {torch.cuda.get_device_name()}")
else:
    print("No CUDA GPU here: recording a graph needs one, so there is no eager-versus-graph timing to show.")

# %% [markdown]
# ## Exercise: the block-table address computation
#
# Write the kernel's address step in torch: `my_block_and_slot(block_table, positions, block_size)` gets one
# request's block table (physical block ids, in the order of its context), some positions of its context and
# the block size, and returns two tensors: the physical block each position's K and V are in, and the slot
# inside that block. (In the kernel: `table + pos // KV_BLOCK_SIZE` is loaded, then `pos % KV_BLOCK_SIZE`
# picks the row.)
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker grades it against the kernel itself: it runs the real Triton kernel in
# the interpreter on the engine's own KV cache and block tables after a real generation, logs every cache row
# each program loads, and asks your function where the same positions are; then it gathers K/V at your
# addresses and compares the attention with the kernel's output. It says *passed*, *not attempted*, or what
# failed, in plain words. The reference solution is `chapters/solutions/ch08_block_and_slot.py`: try first.

# %%
import torch


def my_block_and_slot(block_table: torch.Tensor, positions: torch.Tensor, block_size: int):
    raise NotImplementedError  # your code here: return (physical blocks, slots)


# %%
from minivllm.exercises.ch08 import check_block_and_slot

check_block_and_slot(my_block_and_slot)

# %% [markdown]
# Next: [09 · Serving: an OpenAI-compatible server around the engine](09_serving.ipynb).
