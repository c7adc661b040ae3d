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
# * **first come first served, priority, shortest job first or round-robin**: who waits, and who is pushed
#   out;
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
import statistics
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
    """One engine per mode, its first run recorded (tokens, trace, counters), then timed again: one
    run on a busy machine decides nothing, so the comparison uses the median of `time_runs` below."""
    llm = LLM(num_kv_blocks=num_kv_blocks, preemption_mode=mode, swap_space=0.05, max_num_seqs=8)
    engine, copier = llm.engine, llm.engine.runner.block_copier
    outputs = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)  # also the warm-up of the timings
    return {"llm": llm, "tokens": [o.outputs[0].token_ids for o in outputs], "trace": list(engine.trace),
            "stats": engine.stats(), "runner": engine.runner, "swap_bytes": copier.swap_bytes,
            "swap_seconds": copier.swap_seconds, "seconds": []}


def time_runs(runs: dict, repeats: int = 3) -> None:
    """The same workload again on each engine, the modes alternating so that load hits both alike;
    the prefix cache is dropped first, so each run preempts as the first one did."""
    for _ in range(repeats):
        for r in runs.values():
            r["llm"].reset_prefix_cache()
            start = time.perf_counter()
            r["llm"].generate(PROMPTS[:4], PARAMS, use_tqdm=False)
            r["seconds"].append(time.perf_counter() - start)


roomy = run("recompute", num_kv_blocks=200)
runs = {mode: run(mode) for mode in ("recompute", "swap")}
time_runs(runs)
for mode, r in runs.items():
    s = r["stats"]
    assert r["tokens"] == roomy["tokens"], "preemption must not change a single token"
    print(f"{mode:9s}: {s['num_preemptions']} preemptions, {s['num_steps']} steps, "
          f"{s['num_prefill_tokens_computed']} prefill tokens computed (without pressure: "
          f"{roomy['stats']['num_prefill_tokens_computed']}),\n           {s['num_blocks_swapped_out']} blocks "
          f"swapped out, {r['swap_bytes'] / 2**20:.2f} MiB moved in {r['swap_seconds'] * 1e3:.1f} ms; "
          f"whole run: median {statistics.median(r['seconds']):.3f} s of {len(r['seconds'])}")
print("outputs identical to the run without pressure: True")
medians = {mode: statistics.median(r["seconds"]) for mode, r in runs.items()}
faster, slower = sorted(medians, key=medians.get)
print(f"over the whole run {faster} finished sooner, by {medians[slower] / medians[faster]:.2f}x")

# %% [markdown]
# Both runs write exactly the tokens of the unpressured run. Recompute pays in prefill tokens: every
# victim's prompt *and everything it had written* is computed again. Swap computes nothing twice; it moves
# each victim's blocks out and back in instead, and the trace records which blocks moved when. Which one
# finishes the whole run sooner (the last line above) depends on more than the preemptions: with a model
# this small and a handful of preemptions, the steps both runs share dominate, so the two can be close;
# the next section compares the two costs per token on their own.
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
probe = roomy["llm"]
long_prompt = [5 + i % 1000 for i in range(256)]


def time_copy() -> float:
    """Seconds to move the blocks to the host and back."""
    start = time.perf_counter()
    host_blocks.copy_(device_blocks)
    device_blocks.copy_(host_blocks)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_prefill() -> float:
    """Seconds per token of a 256-token prefill (the prefix cache dropped, so it is all computed)."""
    probe.reset_prefix_cache()
    start = time.perf_counter()
    probe.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - start) / len(long_prompt)


time_copy(), time_prefill()  # warm-up: first touches of the memory, first prefill of this length
copies, prefills = [], []
for _ in range(5):  # alternating, so a burst of load elsewhere hits both
    copies.append(time_copy())
    prefills.append(time_prefill())
bandwidth = 2 * device_blocks.nbytes / statistics.median(copies)
prefill_per_token = statistics.median(prefills)
swap_per_token = 2 * bytes_per_token / bandwidth
print(f"this machine ({runner.device}): {params / 1e6:.1f}M parameters, {bytes_per_token:.0f} bytes of KV per token")
print(f"  swap:      {bandwidth / 1e9:.1f} GB/s -> {swap_per_token * 1e6:.3f} µs per token "
      f"(out and back in);\n             the engine's own swaps: {runs['swap']['swap_bytes'] / 2**20:.2f} MiB in "
      f"{runs['swap']['swap_seconds'] * 1e3:.1f} ms (small copies: per-call overhead dominates)")
print(f"  recompute: {prefill_per_token * 1e6:.1f} µs per token of prefill (medians of 5 alternating runs)")
print(f"  per token, {'swap' if swap_per_token < prefill_per_token else 'recompute'} is cheaper here, by "
      f"{max(prefill_per_token, swap_per_token) / min(prefill_per_token, swap_per_token):,.0f}x")
llama8b_bytes, llama8b_flops = 2 * 32 * 8 * 128 * 2, 2 * 8e9
print(f"8B model on an H100: swap over PCIe {2 * llama8b_bytes / 25e9 * 1e6:.1f} µs per token, "
      f"recompute {llama8b_flops / 400e12 * 1e6:.1f} µs per token")

# %% [markdown]
# On a CPU "host" and "device" are the same memory, so a swap is a plain memcpy and easily beats running
# the model again: per token, swap wins on a CPU by orders of magnitude, because a copy moves only the
# token's KV bytes while a prefill runs every layer (the factor measured here is the last line of "this
# machine" above, a median, so one busy moment does not flip it). On a GPU the two are closer than one
# might think: for an 8B model a token costs ~10 µs of PCIe (out and in) against ~40 µs of tensor-core
# time to recompute (the line above), so swap still wins per token when the victim has a long context;
# but recompute needs no host memory, overlaps with everyone else's decode, and is often partly free
# thanks to the prefix cache. That is why vLLM V1 kept only recompute; minivllm keeps both, so that this
# chapter can measure the difference (`preemption_mode="swap"`, `swap_space=` GiB of host memory; when
# the host pool is full a victim is recomputed instead).

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
# ## Four policies, one workload: who should go next?
#
# When more requests want to run than fit, the queue's order decides who waits. minivllm has four
# `scheduling_policy` values; the rule of each is a few lines of `minivllm/core/scheduling_policy.py`:
#
# * `"fcfs"`: arrival order;
# * `"priority"`: the caller says who matters (here: short requests get priority 0, long ones 1);
# * `"sjf"`, shortest job first: the least *predicted* work first. The prediction is each request's
#   `max_tokens`, lowered by a running average of how long similar requests (prompts of about the same
#   length) really ran; `EngineHooks(predict_output_tokens=...)` replaces it. A request that has waited
#   `sjf_aging_steps` steps goes ahead of every younger one, so a long job cannot starve;
# * `"round_robin"`: once requests are left waiting, a running request that has produced
#   `round_robin_quantum` tokens since it was admitted yields its slot and rejoins the back of the queue
#   (preempted, by recompute or swap as configured): everyone makes progress, at the price of recomputing.
#
# The workload: 24 short requests (4 to 8 tokens) and 3 long ones (96 tokens), arriving over 40 steps, with
# room for 4 at a time. Time is counted in engine steps, which makes the comparison exact: the steps do not
# depend on how busy this machine is (the wall-clock seconds printed beside them do).

# %%
def mixed_workload() -> dict[int, list[tuple[str, list[int], int, int]]]:
    """{arrival step: [(id, prompt, max_tokens, priority)]}: mostly short requests, three long ones."""
    arrivals: dict[int, list] = {}
    for i in range(27):
        long = i % 9 == 0
        arrivals.setdefault(i * 3 // 2, []).append(
            (f"{'long' if long else 'short'}-{i}", PROMPTS[i % 8][: 8 + i % 5], 96 if long else 4 + i % 5,
             1 if long else 0))
    return arrivals


def policy_run(policy: str) -> dict:
    llm = LLM(num_kv_blocks=64, max_num_seqs=4, scheduling_policy=policy, round_robin_quantum=8,
              sjf_aging_steps=64)
    engine, arrivals = llm.engine, mixed_workload()
    arrived, first, done, step, start = {}, {}, {}, 0, time.perf_counter()
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, n, priority in arrivals.get(step, []):
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                               priority=priority if policy == "priority" else 0)
            arrived[rid] = step
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = step
        step += 1
    latency = {r: done[r] - arrived[r] + 1 for r in done}
    ordered = sorted(latency.values())
    short = [v for r, v in latency.items() if r.startswith("short")]
    long = [v for r, v in latency.items() if r.startswith("long")]
    return {"mean latency": sum(ordered) / len(ordered), "p99 latency": ordered[int(0.99 * (len(ordered) - 1))],
            "short mean": sum(short) / len(short), "long mean": sum(long) / len(long),
            "longest wait": max(first[r] - arrived[r] for r in done), "steps": step,
            "preemptions": engine.scheduler.num_preemptions,
            "prompt tokens": engine.stats()["num_prefill_tokens_computed"], "seconds": time.perf_counter() - start}


POLICY_NAMES = ("fcfs", "priority", "sjf", "round_robin")
results = {policy: policy_run(policy) for policy in POLICY_NAMES}
print("latency and waits in engine steps; 'prompt tokens': prefill tokens computed, recomputation included")
print(f"{'policy':12s} {'mean':>6s} {'p99':>5s} {'short':>6s} {'long':>6s} {'longest wait':>12s} {'steps':>5s} "
      f"{'preempted':>9s} {'prompt tokens':>13s}")
for policy, r in results.items():
    print(f"{policy:12s} {r['mean latency']:6.1f} {r['p99 latency']:5d} {r['short mean']:6.1f} {r['long mean']:6.1f} "
          f"{r['longest wait']:12d} {r['steps']:5d} {r['preemptions']:9d} {r['prompt tokens']:13d}"
          f"   ({r['seconds']:.1f} s)")

fig = Figure(figsize=(10, 3.2))
axes = fig.subplots(1, 3)
for ax, metric in zip(axes, ("short mean", "long mean", "longest wait")):
    ax.bar(POLICY_NAMES, [results[p][metric] for p in POLICY_NAMES], color=["#888", "#c84", "#48c", "#4a4"])
    ax.set_title({"short mean": "short requests: mean latency", "long mean": "long requests: mean latency",
                  "longest wait": "longest wait for a first token"}[metric] + " (steps)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
fig.tight_layout()
widgets.show(fig)

# %%
fcfs, sjf, rr = results["fcfs"], results["sjf"], results["round_robin"]
longer = sjf["long mean"] - fcfs["long mean"]
print(f"SJF: short requests finish {fcfs['short mean'] / sjf['short mean']:.1f}x sooner than under FCFS "
      f"({sjf['short mean']:.1f} vs {fcfs['short mean']:.1f} steps);\n  the long ones "
      + (f"take {longer:.1f} steps longer ({sjf['long mean']:.1f} vs {fcfs['long mean']:.1f})." if longer > 0 else
         f"lose nothing here ({sjf['long mean']:.1f} vs {fcfs['long mean']:.1f} steps)."))
print(f"Round-robin: nobody waits more than {rr['longest wait']} steps for a first token (FCFS: "
      f"{fcfs['longest wait']}),\n  bought with {rr['preemptions']} preemptions: {rr['prompt tokens']} prompt tokens "
      f"computed against FCFS's {fcfs['prompt tokens']}.")

# %% [markdown]
# The trade-off, read from the table: shortest-job-first gives the short requests, which are most
# requests, the lowest latency, because nobody waits behind a long job; the long jobs wait longer, up to
# the aging bound. Priority does the same when the caller knows who is short; SJF has to guess, and guesses
# better as it sees more requests finish. Round-robin bounds how long anyone waits for a first token
# (streams start sooner), but every yield is a preemption: with recompute its prompt and tokens are
# computed again, so the same work takes more steps. FCFS is the simplest and the fairest in arrival order,
# and the worst for short requests stuck behind long ones. The tests hold each policy to its promise on the
# real step: `tests/test_scheduling_policies.py` (same greedy tokens under every policy, short jobs first,
# the aging bound, shared slots) and the leak property test in `tests/test_block_pool_properties.py`.

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
beam_prompt = llm.tokenizer.encode("Once upon a time, there was a little girl named Lily. One day, she")
out = llm.beam_search([beam_prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
print("cumulative logprob, then the beam's six tokens as text and as ids")
for seq in out.sequences:
    new = seq.tokens[len(beam_prompt):]
    print(f"{seq.cum_logprob:8.3f}  {llm.tokenizer.decode(new)!r:40s} {new}")
trace = list(llm.engine.trace)
display(HTML(widgets.fork_html(trace[:4])))
stats = llm.engine.stats()
print(f"forks shared {stats['num_forked_blocks']} blocks by reference; "
      f"copy-on-write copied {stats['num_cow_copies']} of them\n"
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
# | `scheduling_policy="sjf"` | long requests wait (up to the aging bound) | most requests are short |
# | `scheduling_policy="round_robin"` | recomputing each yielded request | streams must start soon |
# | beam search with copy-on-write | one block copy per fork | always, next to copying whole tables |

# %% [markdown]
# ## Exercise: whom priority preempts
#
# Write the `"priority"` policy's victim choice: `my_preempt_victim(running, outranked_by)` gets the running
# sequences (each has `priority_key`, the tuple `(priority, arrival_time)`) and, when a *waiting* request
# needs blocks, that request (`outranked_by`; `None` when a running one needs them). Return the sequence to
# preempt, or `None` for nobody: the running sequence with the largest key, but for a waiting request only
# if the victim's key is larger than the waiting request's (otherwise the waiting one waits).
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your rule into the real scheduler through its documented hook,
# `LLM(hooks=EngineHooks(preempt_victim=...))` (`minivllm.hooks`; nothing is patched), on a tight pool where
# urgent requests arrive behind a batch: every step must preempt the same requests as the engine's own policy,
# with the same tokens in the end. It says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch11_preempt_victim.py`: try first.

# %%
def my_preempt_victim(running, outranked_by):
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch11 import check_preempt_victim

check_preempt_victim(my_preempt_victim)

# %% [markdown]
# Next: [12 · Quantization: the formats learners download](12_quantization.ipynb).
