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
# # 11 · Memory pressure
#
# The KV cache is a fixed pool of blocks. When the running requests want more blocks than are free, the
# scheduler must take some back: it *preempts* a request. What the victim loses, and who the victim is, are
# policy. This chapter runs the real engine with a pool far too small for its workload and looks at three
# choices vLLM offers:
#
# * **recompute or swap**: throw the victim's blocks away and prefill it again later (FLOPs), or copy them to
#   host memory and back (bytes over PCIe). vLLM's own log on an H100 shows both pools side by side:
#   `# GPU blocks: 32350, # CPU blocks: 11915` (the CPU ones are `swap_space=4` GiB of pinned memory);
# * **first come first served, or priority**: who waits, and who is pushed out;
# * **beam search**, where several sequences share their prompt's blocks by reference count and copy only
#   the partly filled block they write into (copy-on-write).

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
import time

import torch
from IPython.display import HTML, display
from matplotlib.figure import Figure

from minivllm import LLM, BeamSearchParams, SamplingParams, widgets

# %% [markdown]
# ## A pool too small for the work
#
# Four requests, each with a 32-token prompt and 24 tokens to write, need 4 blocks of 16 tokens apiece at
# the end: 16 blocks in all. The pool has 9. The same workload runs twice, once per `preemption_mode`, with
# the embedded model, greedy decoding, and `trace_steps` on so the engine records every step.

# %%
PROMPTS = [[(11 * i + j) % 1500 + 5 for j in range(32)] for i in range(8)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(mode: str, num_kv_blocks: int = 9) -> dict:
    llm = LLM(num_kv_blocks=num_kv_blocks, preemption_mode=mode, swap_space=0.05, max_num_seqs=8)
    engine = llm.engine
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"llm": llm, "seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outputs],
            "trace": list(engine.trace), "stats": engine.stats(), "runner": engine.runner}


roomy = run("recompute", num_kv_blocks=200)
runs = {mode: run(mode) for mode in ("recompute", "swap")}
for mode, r in runs.items():
    s = r["stats"]
    assert r["tokens"] == roomy["tokens"], "preemption must not change a single token"
    print(f"{mode:9s}: {s['num_preemptions']} preemptions, {s['num_steps']} steps, "
          f"{s['num_prefill_tokens_computed']} prefill tokens computed (without pressure: "
          f"{roomy['stats']['num_prefill_tokens_computed']}), {s['num_blocks_swapped_out']} blocks swapped out, "
          f"{r['runner'].block_copier.swap_bytes / 2**20:.2f} MiB moved in "
          f"{r['runner'].block_copier.swap_seconds * 1e3:.1f} ms; "
          f"{r['seconds']:.2f} s")
print("outputs identical to the run without pressure: True")

# %% [markdown]
# Both runs write exactly the tokens of the unpressured run. Recompute pays in prefill tokens: every
# victim's prompt *and everything it had written* is computed again. Swap computes nothing twice; it moves
# each victim's blocks out and back in instead, and the trace records which blocks moved when.
#
# Below, the two timelines (the widget of chapter 04, reading the engine's trace): purple is a preemption
# by recompute, blue a swap-out. A swapped-in request goes straight back to *decode* (green); a recomputed
# one starts again with a long *prefill* (red, with its token count).

# %%
fig = Figure(figsize=(10, 5))
axes = fig.subplots(2, 1)
for ax, (mode, r) in zip(axes, runs.items()):
    widgets.timeline_figure(widgets.timeline(r["trace"]), ax=ax,
                            title=f"preemption_mode={mode!r}: {r['stats']['num_steps']} steps")
fig.tight_layout()
widgets.show(fig)
print("swap, from the trace:", widgets.swap_totals(runs["swap"]["trace"]))

# %% [markdown]
# ## When each wins
#
# A preempted request that has `n` tokens in the cache costs, when it comes back:
#
# * **recompute**: a prefill of `n` tokens, about `2 × parameters × n` FLOPs. On a GPU prefill is compute
#   bound and runs near peak; it also shares the step with everyone else's work, and with prefix caching
#   part of it may be a cache hit.
# * **swap**: `2 × n × bytes per token` over the host link (out, then in): PCIe 4.0 x16 moves about
#   25 GB/s, an H100's HBM 3,000 GB/s. It needs no compute, but it needs host memory, and the copies sit
#   on the step's critical path.
#
# Here are both costs per token, measured on the machine at hand: the copy bandwidth of a 64 MiB block
# move between the cache's device and (pinned) host memory, and the time of a 256-token prefill. Then the
# same arithmetic for an 8B model on an H100 (fp16: 128 KiB of K and V per token; PCIe 4.0 at 25 GB/s;
# ~400 TFLOP/s of achieved prefill throughput).

# %%
runner = runs["swap"]["runner"]
bytes_per_token = runner.bytes_per_block / runner.config.block_size
params = sum(p.numel() for p in runner.model.parameters())
cuda = runner.device.type == "cuda"
device_blocks = torch.zeros(64 * 2**20 // 4, dtype=torch.float32, device=runner.device)
host_blocks = torch.empty(device_blocks.shape, dtype=torch.float32, pin_memory=cuda)
for _ in range(2):  # the second copy is the one timed
    start = time.perf_counter()
    host_blocks.copy_(device_blocks)
    device_blocks.copy_(host_blocks)
    if cuda:
        torch.cuda.synchronize()
    copy_seconds = time.perf_counter() - start
bandwidth = 2 * device_blocks.nbytes / copy_seconds
probe = roomy["llm"]
for _ in range(2):
    start = time.perf_counter()
    probe.generate([[5 + i % 1000 for i in range(256)]], SamplingParams(max_tokens=1), use_tqdm=False)
    prefill_per_token = (time.perf_counter() - start) / 256
print(f"this machine ({runner.device}): {params / 1e6:.1f}M parameters, {bytes_per_token:.0f} bytes of KV per token")
print(f"  swap:      {bandwidth / 1e9:.1f} GB/s -> {2 * bytes_per_token / bandwidth * 1e6:.3f} µs per token "
      f"(out and back in); the engine's own swaps: {runner.block_copier.swap_bytes / 2**20:.2f} MiB in "
      f"{runner.block_copier.swap_seconds * 1e3:.1f} ms (small copies: per-call overhead dominates)")
print(f"  recompute: {prefill_per_token * 1e6:.1f} µs per token of prefill")
llama8b_bytes, llama8b_flops = 2 * 32 * 8 * 128 * 2, 2 * 8e9
print(f"8B model on an H100: swap over PCIe {2 * llama8b_bytes / 25e9 * 1e6:.1f} µs per token, "
      f"recompute {llama8b_flops / 400e12 * 1e6:.1f} µs per token")

# %% [markdown]
# On a CPU "host" and "device" are the same memory, so a swap is a plain memcpy and easily beats running
# the model again: swap wins here by orders of magnitude (see the two lines above). On a GPU the two are
# closer than one might think: for an 8B model a token costs ~10 µs of PCIe (out and in) against ~40 µs
# of tensor-core time to recompute, so swap still wins per token when the victim has a long context; but
# recompute needs no host memory, overlaps with everyone else's decode, and is often partly free thanks to
# the prefix cache. That is why vLLM V1
# kept only recompute; minivllm keeps both, so that this chapter can measure the difference
# (`preemption_mode="swap"`, `swap_space=` GiB of host memory; when the host pool is full a victim is
# recomputed instead).

# %% [markdown]
# ## Priority: who waits, and who is pushed out
#
# With `scheduling_policy="priority"` every request carries a `priority` (lower runs first; ties by
# arrival, as in vLLM). The waiting queue is kept in that order, and a waiting request that cannot get
# blocks may preempt running requests of *lower* priority: the victim is the running request with the
# largest (priority, arrival). Below, four low-priority requests fill the pool; two urgent ones arrive
# later.

# %%
def priority_run(policy: str) -> tuple[list[str], list]:
    llm = LLM(num_kv_blocks=9, scheduling_policy=policy, max_num_seqs=8)
    engine, order = llm.engine, []
    batch = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"batch-{i}", PROMPTS[i], batch, priority=9 if policy == "priority" else 0)
    for step in range(40):
        if step == 3:
            for i in range(2):
                engine.add_request(f"urgent-{i}", PROMPTS[6 + i], SamplingParams(temperature=0, max_tokens=8))
        order += [o.request_id for o in engine.step() if o.finished]
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order, list(engine.trace)


fig = Figure(figsize=(10, 5))
axes = fig.subplots(2, 1)
for ax, policy in zip(axes, ("fcfs", "priority")):
    order, trace = priority_run(policy)
    print(f"{policy:8s}: finish order {order}")
    widgets.timeline_figure(widgets.timeline(trace), ax=ax, title=f"scheduling_policy={policy!r}")
fig.tight_layout()
widgets.show(fig)

# %% [markdown]
# Under FCFS the urgent requests queue behind the batch. Under priority they take the blocks of the newest
# low-priority requests at once and finish first; within one priority level the order stays first come,
# first served, so nobody at a given level starves behind later arrivals of the same level (the tests
# check both: `tests/test_memory_policy.py`, and the property tests of `tests/test_block_pool_properties.py`).
# The same `priority` goes through `LLM.generate(..., priority=[...])` and the server's request body, as in
# vLLM.

# %% [markdown]
# ## Beam search on copy-on-write blocks
#
# `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))` keeps the `beam_width` best
# sequences. Each round every beam is *forked* for its best next tokens: the fork gets its parent's whole
# block table by reference count, with no copy. The first time a fork writes into a block it shares (the
# partly filled last one) it gets its own copy of that block (copy-on-write); full blocks stay shared.
# The widget draws every live beam's table at each step, straight from the trace.

# %%
llm = LLM(num_kv_blocks=64)
out = llm.beam_search([PROMPTS[0][:20]], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
for seq in out.sequences:
    print(f"{seq.cum_logprob:8.3f}  {seq.tokens[20:]}")
trace = list(llm.engine.trace)
display(HTML(widgets.fork_html(trace[:4])))
stats = llm.engine.stats()
print(f"forks shared {stats['num_forked_blocks']} blocks by reference; "
      f"copy-on-write copied {stats['num_cow_copies']} of them "
      f"({stats['num_forked_blocks'] - stats['num_cow_copies']} block copies saved against copying whole tables)")

# %% [markdown]
# A fork costs at most one block copy, whatever the length of the prompt: with a long prompt and a wide
# beam the savings grow with both. (The tests check that minivllm's beams and scores equal those of
# transformers' `generate(num_beams=...)` on tiny models, and that beams under a tiny pool, preempted by
# recompute or by swap, come out the same.)
#
# | choice | costs | wins when |
# |---|---|---|
# | `preemption_mode="recompute"` | FLOPs: prefill all the victim had | short contexts, idle compute, cached prefix |
# | `preemption_mode="swap"` | host memory, link bandwidth both ways | long contexts, a fast link next to the FLOPs |
# | `scheduling_policy="priority"` | the low-priority work it pushes out | some requests must not wait |
# | beam search with copy-on-write | one block copy per fork | always, next to copying whole tables |

# %% [markdown]
# Next: [12 · Quantization: the formats learners download](12_quantization.ipynb).
