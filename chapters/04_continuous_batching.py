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
# # 04 · Continuous batching, the token budget, chunked prefill and preemption
#
# A GPU is busiest when many sequences share each forward pass. **Static batching** forms a batch, runs
# it until its longest sequence ends, and only then takes new requests: finished sequences leave idle
# slots behind, and newcomers wait. **Continuous batching** reschedules at every step: finished requests
# leave, waiting ones join. Both are run here on the real engine and drawn from its trace.

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
import dataclasses
import inspect
import textwrap

from IPython.display import display
from matplotlib.figure import Figure

from minivllm import LLM, EngineConfig, SamplingParams, widgets
from minivllm.core.scheduler import Scheduler

llm = LLM()

# %% [markdown]
# ## The toy schedule
#
# Five requests, as (arrival step, tokens to generate): (0, 10), (1, 5), (3, 15), (5, 3),
# (6, 7). A clock ticks once per engine step. `widgets.run_arrivals` hands each request to the engine:
#
# * **continuous**: at its arrival tick, and the engine's scheduler does the rest;
# * **static**, batch size 2: in arrival order, two at a time, and a pair only once both have arrived and
#   the previous pair has completely finished.
#
# Every request generates exactly its token count (`max_tokens`, `ignore_eos=True`), greedily.

# %%
print(inspect.getsource(widgets.run_arrivals))

# %%
schedule = [(0, 10), (1, 5), (3, 15), (5, 3), (6, 7)]
texts = ["Hi, my name is", "Today is a beautiful summer day", "Hello there", "Once upon a time", "The cat"]


def toy(prefix):
    return [widgets.Arrival(f"{prefix}{i}", arrival, text, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for i, ((arrival, n), text) in enumerate(zip(schedule, texts))]


continuous = widgets.run_arrivals(llm.engine, toy("R"), "continuous")
static = widgets.run_arrivals(llm.engine, toy("R"), "static", batch_size=2)

fig = Figure(figsize=(10, 5.2))  # 10 inches: legible in a 1400-pixel window
for rec, ax in zip((static, continuous), fig.subplots(2, 1)):
    tl = widgets.timeline(rec.steps, rec.clock, rec.arrivals)
    widgets.timeline_figure(tl, f"{rec.policy} batching: done after {rec.num_ticks} ticks", ax=ax, xlabel="clock tick")
    ax.set_xlim(0, static.num_ticks + 0.5)  # the same scale for both
widgets.show(fig)

# %% [markdown]
# (A `>` marks each arrival, a black bar each finish; red is a prefill with its token count, green a
# decode step, grey waiting.)

# %%
print(f"{'request':8s} {'arrives':>7s} {'tokens':>6s} | {'static: done':>12s} {'latency':>7s} | "
      f"{'continuous: done':>16s} {'latency':>7s}")
for i, (arrival, n) in enumerate(schedule):
    rid = f"R{i}"
    print(f"{rid:8s} {arrival:7d} {n:6d} | {static.finished[rid]:12d} {static.latency(rid):7d} | "
          f"{continuous.finished[rid]:16d} {continuous.latency(rid):7d}")
mean = {rec.policy: sum(rec.latency(r) for r in rec.finished) / len(rec.finished) for rec in (static, continuous)}
print(f"mean latency: static {mean['static']:.1f} ticks, continuous {mean['continuous']:.1f} ticks")
print(f"all done after: static {static.num_ticks} ticks, continuous {continuous.num_ticks} ticks")

# The timeline as measured: under continuous batching no request waits for another, under static batching they do.
assert {r: continuous.latency(r) for r in continuous.finished} == {f"R{i}": n for i, (_, n) in enumerate(schedule)}, \
    "continuous: every request starts when it arrives and takes exactly its token count"
assert static.finished == {"R0": 10, "R1": 5, "R2": 25, "R3": 13, "R4": 32}
assert continuous.num_ticks == 18 and static.num_ticks == 33
assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(
    [continuous.outputs[f"R{i}"] for i in range(5)], schedule))

# %% [markdown]
# Static batching idles twice: slots sit empty after a short request finishes (R1 at tick 5, R3 at 13)
# while others wait in the queue, and a batch cannot start until its last member arrives. Continuous
# batching uses every step for whoever is there, so every request's latency is just its own length.
#
# ## Ten threads, one batch
#
# The same thing with real concurrency, as it is often demonstrated: ten threads share one `LLM`, and each calls
# `llm.generate([prompt], params)` for its own prompt, starting a little after the one before. vLLM's own
# `LLM` is not thread-safe (for concurrent callers vLLM points to its server or `AsyncLLM`); minivllm's is.
# Only one thread steps the engine at a time; the others hand over their requests, which join the running
# batch before the next step, and wait for their own outputs (`engine/step_driver.py`). A request can also
# be stopped from another thread with `llm.abort_request(request_id)`.

# %%
import threading
import time

shared = LLM()
first_step = shared.engine.num_steps
finished = {}


def worker(i: int) -> None:
    time.sleep(0.01 * i)  # staggered starts
    params = SamplingParams(temperature=0.8, seed=i, max_tokens=12 + 6 * (i % 4), ignore_eos=True)
    out = shared.generate([f"Request {i}: once upon a time"], params, use_tqdm=False)[0]
    finished[i] = out.request_id


threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
# Every thread gets its output back from the one engine loop.
assert not any(t.is_alive() for t in threads) and len(finished) == 10, "every thread gets its output"
steps = widgets.relabel_requests(widgets.new_steps(shared.engine, first_step),
                                 {rid: f"thread {i}" for i, rid in finished.items()})
tl = widgets.timeline(steps)
widgets.show(widgets.timeline_figure(tl, "10 threads calling generate() on one shared LLM"))
per_step = [len(t.scheduled) for t in steps]
print(textwrap.fill(f"requests in each step: {per_step}", 100, subsequent_indent="  "))
# Requests submitted from different threads were batched into the same steps.
assert max(per_step) >= 3, "the threads' requests ran in shared steps"

# %% [markdown]
# Each row is one thread's request; its first cell is its prefill (with the prompt's token count). Requests
# that arrive while a step is running go in together right before the next one, then all decode side by side
# in the same steps, and each thread returns as soon as its own request finishes: one batch, fed by ten threads.
#
# ## The token budget
#
# Each step computes at most `max_num_batched_tokens` tokens (2048 by default). The scheduler serves
# running requests first (decodes, 1 token each), then admits waiting prompts first-come-first-served
# while they fit. Here is the scheduling loop:

# %%
print(inspect.getsource(Scheduler.schedule))

# %% [markdown]
# The scheduler's decision then goes to the model runner as plain data (a `SchedulerOutput`). The runner's
# side of the step is a fixed list of phases over one record per scheduled sequence (a `StepRow`): each
# phase reads the rows, does one thing, and writes its result onto them (`raw_logprobs`, from
# `runner/logprobs.py`, reads the logits before anything changes them). This is the whole step, as it runs:

# %%
from minivllm.runner.model_runner import ModelRunner

print(inspect.getsource(ModelRunner.execute))
phases = ["update_states", "step_rows", "forward", "mask_grammar", "sample", "verify_drafts", "commit", "propose"]
for name in phases:
    lines = len(inspect.getsourcelines(getattr(ModelRunner, name))[0])
    doc = inspect.getdoc(getattr(ModelRunner, name)).splitlines()[0]
    print(textwrap.shorten(f"  ModelRunner.{name:<14} {lines:3d} lines   {doc}", 100, placeholder=" ..."))
body = inspect.getsource(ModelRunner.execute)
# The step runs its phases in the order the prose lists them.
assert [body.index(f"self.{name}(") for name in phases] == sorted(body.index(f"self.{name}(") for name in phases)

# %% [markdown]
# Sixteen prompts of 150 tokens arrive together: 2400 tokens, more than one step's 2048. The first step
# prefills as many as fit, first come first served, and starts the next one with whatever budget is left
# (a chunk); the second step finishes that chunk and prefills the rest.

# %%
burst_ids = llm.tokenizer.encode(("Once upon a time, there was a little girl named Lily. She loved to play "
                                  "outside in the sun. One day, she saw a big red ball in the park. ") * 6)
# The burst is long enough to overflow one step's token budget.
assert len(burst_ids) >= 165
start = llm.engine.num_steps
llm.generate([{"prompt_token_ids": burst_ids[i : i + 150]} for i in range(16)],
             SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
burst = widgets.new_steps(llm.engine, start)
for t in burst[:2]:
    print(f"step {t.step}: {t.num_tokens} tokens =", [(e.request_id, e.num_tokens) for e in t.scheduled][:3], "...",
          [(e.request_id, e.num_tokens) for e in t.scheduled][-2:])
# The first step fills the 2048-token budget exactly; the next finishes the cut prompt and decodes the rest.
assert burst[0].num_tokens == 2048 == llm.engine.config.max_num_batched_tokens
assert [e.num_tokens for e in burst[0].scheduled] == [150] * 13 + [98] and len(burst[0].waiting) == 2
assert burst[1].num_prefill_tokens == 2400 - 2048 and burst[1].num_decode_tokens == 13

# %% [markdown]
# ## Chunked prefill
#
# A long prompt that does not fit the budget is cut into chunks over several steps, and the requests
# already running keep decoding in every one of those steps instead of stalling behind it. We make the
# budget tiny (`max_num_batched_tokens=32`) so the effect is visible: two short requests are decoding
# when a 150-token prompt arrives.
#
# (The extra engines in this notebook get a fixed `num_kv_blocks`. On a GPU, `LLM()` without one sizes
# its cache to fill `gpu_memory_utilization` = 90% of the device, as vLLM does, so a second engine sized
# the same way would find no memory left. They also compute in float32, on purpose: the comparisons below
# are exact there. In bf16 (the default on CPUs that have it) or a GPU's fp16, a different chunking adds
# up the same numbers in a different order, rounds differently and, at a near tie, can flip a greedy pick;
# chapter 07 measures such a flip.)

# %%
story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
         "One day, she saw a big red ball in the park. ") * 6
long_ids = llm.tokenizer.encode(story)[:150]
# The long prompt has exactly 150 tokens, so the chunk sizes below add up to a known total.
assert len(long_ids) == 150
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
jobs = [widgets.Arrival("short-a", 0, "Hello there", greedy), widgets.Arrival("short-b", 0, "The cat", greedy),
        widgets.Arrival("long", 2, {"prompt_token_ids": long_ids}, greedy)]
chunked = LLM(max_num_batched_tokens=32, num_kv_blocks=64, dtype="float32")  # see the notes below
rec = widgets.run_arrivals(chunked.engine, jobs, "continuous")
tl = widgets.timeline(rec.steps, rec.clock, rec.arrivals)
widgets.show(widgets.timeline_figure(tl, "max_num_batched_tokens=32: the long prompt is prefilled in chunks",
                                     xlabel="clock tick"))
chunks = [tl.tokens["long", x] for x in range(tl.last_x + 1) if tl.cells.get(("long", x)) == "prefill"]
print("prefill chunks of the long prompt:", chunks)
# Chunked prefill splits the long prompt into budget-sized pieces while the short requests keep decoding.
assert sum(chunks) == 150 and max(chunks) <= 32 and len(chunks) >= 5
assert all(t.num_tokens <= 32 for t in rec.steps)
assert all(tl.cells[rid, x] == "decode" for rid in ("short-a", "short-b") for x in range(1, 12)), \
    "the short requests decode in every step while the long prompt is chunked"

# %% [markdown]
# Chunking changes when work happens, never what is computed: the same requests with the default budget
# give the same tokens.

# %%
exact = LLM(num_kv_blocks=256, dtype="float32")  # the default budget of 2048 tokens, and room to spare
reference = widgets.run_arrivals(exact.engine, jobs, "continuous")
# Chunking changes when tokens are computed, never which tokens come out.
assert {r: o.outputs[0].token_ids for r, o in rec.outputs.items()} == \
    {r: o.outputs[0].token_ids for r, o in reference.outputs.items()}
print("identical outputs with a 32-token and a 2048-token budget")

# %% [markdown]
# ## Preemption when blocks run out
#
# Admission checks that a request's *next* tokens have blocks, not that its whole future output will.
# When a running request needs a new block and none is free, the scheduler **preempts** the newest
# running request: its blocks are freed and it goes back to the head of the waiting queue, to be
# recomputed later (its prompt plus everything it had generated, in one prefill). That is the default
# (`preemption_mode="recompute"`, as in vLLM's current engine); the other way, *swapping* the blocks to CPU
# memory and back (`preemption_mode="swap"`), is chapter 11's, which measures the two against each other.
#
# Four requests of about 140 tokens each need about 9 blocks apiece; we give the engine 12.

# %%
prompts = [llm.tokenizer.encode(story)[i * 10 : i * 10 + 40] for i in range(4)]
long_out = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
tight = LLM(num_kv_blocks=12, dtype="float32")
start = tight.engine.num_steps
squeezed = tight.generate([{"prompt_token_ids": p} for p in prompts], long_out, use_tqdm=False)
steps = widgets.new_steps(tight.engine, start)
tl = widgets.timeline(steps)
widgets.show(widgets.timeline_figure(tl, "12 KV blocks for 4 requests of ~140 tokens: preemption (purple)"))
stats = tight.engine.stats()
print(f"preemptions: {stats['num_preemptions']}; per request:", [o.num_preemptions for o in squeezed])
recomputed = [(t.step, e.request_id, e.num_tokens) for t in steps for e in t.scheduled
              if e.kind == "prefill" and e.num_tokens > 40]
print("recompute prefills (step, request, tokens):", recomputed[:6])
# With too few blocks the engine preempts, recomputes the victim's prefill, and frees every block at the end.
assert stats["num_preemptions"] > 0 and recomputed
assert stats["num_free_blocks"] == 12

# %%
before = exact.engine.stats()["num_preemptions"]
expected = exact.generate([{"prompt_token_ids": p} for p in prompts], long_out, use_tqdm=False)
# Preemption changes the schedule, not the output: the squeezed run matches one that never preempted.
assert exact.engine.stats()["num_preemptions"] == before, "256 blocks are enough: no preemption"
assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in expected]
print("identical outputs with 12 blocks (preempting) and 256 blocks (never preempting)")

# %% [markdown]
# Step through the tight run: it opens on the first preemption; **next preemption** jumps to the next
# one. Watch the preempted request's blocks go back to the pool.
#
# A **next prefix hit** button appears when the recording has one (it is offered only then): a step in
# which a request got some of its blocks back from the prefix cache (chapter 06) instead of computing
# them. Here that is a preempted request returning: its full blocks were freed but keep their contents
# and hash until the pool hands them out again, so if no one took them meanwhile its recompute starts
# after them. The line below lists the hits in this run, from the trace.

# %%
hits = [(t.step, request, len(blocks)) for t in steps for request, blocks in t.cache_hits.items()]
print("prefix hits (step, request, blocks re-used):", hits or "none in this run (their blocks were reused)")
stepper = widgets.JourneyStepper(steps, tokenizer=tight.tokenizer, max_blocks=12)
stepper.index = next(i for i, t in enumerate(steps) if t.preempted)
display(stepper)

# %% [markdown]
# ## What the CPU spends a step on
#
# Batching pays because a decode step's cost is mostly fixed: every weight is read once per step whether one
# sequence or sixty-four ride along, and the Python around the model (scheduling, building the flat batch,
# sampling, detokenizing) is paid per step too. The engine times each part of every step (`StepRecord.
# phase_seconds`, and the runner's `forward_seconds`); a step observer keeps the records, and
# `widgets.step_time_breakdown` takes their median. Measured here, on this machine, in decode steps at batch 1 and 64:

# %%
def decode_step_records(engine_llm, batch: int, steps: int = 12) -> list:
    """Run `batch` requests through the engine; return the records of `steps` steps where all of them decode."""
    engine = engine_llm.engine
    for i in range(batch):
        engine.add_request(f"timing-{batch}-{i}", {"prompt_token_ids": [5 + i % 50] * 16},
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    records = []
    keep = lambda eng, record: records.append(record)  # noqa: E731  (a step observer)
    engine.add_step_observer(keep)
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_step_observer(keep)
    decodes = [r for r in records if len(r.scheduler_output.scheduled) == batch
               and all(s.num_new_tokens == 1 for s in r.scheduler_output.scheduled)]
    return decodes[:steps]


timing_llm = LLM(max_num_seqs=64)
decode_step_records(timing_llm, 4)  # warm-up: first calls allocate and load kernels
breakdowns = {f"batch {b}": widgets.step_time_breakdown(decode_step_records(timing_llm, b)) for b in (1, 64)}
for label, parts in breakdowns.items():
    print(textwrap.fill(f"{label:9s} " + ", ".join(f"{part} {ms:.2f} ms" for part, ms in parts.items())
                        + f"  -> host {widgets.host_share(parts):.0%}", 100, subsequent_indent="          "))
widgets.show(widgets.step_time_figure(breakdowns, f"minivllm-tiny, dtype {timing_llm.engine.config.dtype}"))
per_token = {label: sum(parts.values()) / int(label.split()[1]) for label, parts in breakdowns.items()}
# Batching spreads a step's fixed cost over more tokens, so each token costs less at batch 64.
assert per_token["batch 64"] < per_token["batch 1"], per_token  # batching makes each token cheaper

# %% [markdown]
# At batch 64 the step costs only a few times batch 1's while it produces 64 times the tokens: that is the whole
# case for continuous batching. The host's share printed above is what Python and the scheduler cost on this tiny
# model, whose matrices are small; on the 135M-parameter model of `bench/cpu_peer.py` the forward pass is over 90%
# of a decode step at both sizes (`bench/RESULTS.md` has that profile), so there the weights' memory traffic, not
# Python, sets the pace.

# %% [markdown]
# ## The knobs
#
# These engine settings shape all of this (vLLM's names; see its
# [engine arguments](https://docs.vllm.ai/en/latest/configuration/engine_args.html)). They are
# `EngineConfig` fields, passed to `LLM(...)` as keyword arguments:

# %%
knobs = ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "gpu_memory_utilization",
         "enable_chunked_prefill", "num_kv_blocks"]
defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
for name in knobs:
    print(f"{name:24s} default {defaults[name]!r}")
# The defaults we quote are the engine's own.
assert defaults["max_num_batched_tokens"] == 2048 and defaults["block_size"] == 16

# %% [markdown]
# The scheduling policy itself is first come, first served; others are shortest job first,
# round-robin and priority scheduling, which differ only in the order `schedule()` walks the queue.

# %% [markdown]
# ## Exercise: admission under the token budget
#
# After the running requests, the scheduler admits waiting ones in FCFS order while budget is left. For the
# request at the head it asks: of its `num_remaining` tokens, how many fit in the `budget` still left this
# step? All of them if they fit. If not: with chunked prefill, a chunk that fills the budget (the rest comes
# next step); without it, none (0: it waits, and so does everyone behind it). Write that rule.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(prefill_chunk=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch04_prefill_chunk.py`: try first.
#
# The checker runs your rule inside the real engine on random workloads (generated by `hypothesis`),
# checking after every step that the step stayed within `max_num_batched_tokens` and that, without chunked
# prefill, no prompt was cut; then it compares greedy tokens with transformers when every prompt is chunked.

# %%
def my_prefill_chunk(num_remaining: int, budget: int, enable_chunked_prefill: bool) -> int:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch04 import check_prefill_chunk

check_prefill_chunk(my_prefill_chunk)

# %% [markdown]
# Next: [05 · Sampling: from logits to the next token](05_sampling.ipynb).
