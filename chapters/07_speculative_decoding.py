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
# # 07 · Speculative decoding: draft cheaply, verify in one pass
#
# Decoding makes one token per step per request, and each step runs the whole model. Speculative decoding
# lets a cheap **drafter** guess the next few tokens (say 5), and the big **verifier** (the target model)
# check all of them in one forward pass: it scores the k drafts and one more position at once. Where it
# agrees, the drafts are kept; at the first disagreement its own token replaces the draft (for example: the
# target disagrees at draft 3, so drafts 1 and 2 are kept and token 3 is the target's own); if it agrees with
# all k, its prediction after them is a free **bonus** token. So one target pass yields between 1 and k + 1
# tokens, and the output is what the target alone would have produced: exactly so in float32; in bf16 or
# fp16 up to rounding, as the section "Equal up to rounding" below measures.
#
# Our drafter is either a small model trained on the same stories (`minivllm-tiny-draft`, with its own
# paged KV cache) or no model at all: n-gram lookup in the text so far.

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
import gc
import inspect
import time

import torch
from IPython.display import display
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams, widgets
from minivllm.config import DEFAULT_DRAFT_MODEL
from minivllm.sampling import rejection_sampler
from minivllm.spec_decode import DraftModelProposer, NgramProposer

if not torch.cuda.is_available():
    # A model this small gains little from a second CPU thread, and one thread keeps the timings below
    # steady when other programs share the machine.
    torch.set_num_threads(1)

PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

plain = LLM(num_kv_blocks=64)  # every engine timed below gets the same small cache
tok = plain.tokenizer
DTYPE = plain.engine.config.dtype  # "auto": bf16 on a CPU that has it, fp16 or bf16 on a GPU, else float32
# the top two logprobs at every position of plain decoding: how close each greedy choice was
plain_outs = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
reference = [o.outputs[0].token_ids for o in plain_outs]
margins = [[abs(a.logprob - b.logprob) for a, b in (sorted(lp.values(), key=lambda x: -x.logprob)[:2]
                                                  for lp in o.outputs[0].logprobs)] for o in plain_outs]
print(f"dtype {DTYPE}")
for prompt, ids in zip(PROMPTS, reference):
    print(f"{prompt!r} -> {tok.decode(ids)!r}")

# %% [markdown]
# In float32 speculative decoding must reproduce these tokens exactly, and the chapter asserts it. In bf16
# and fp16 a logit has only 8 or 11 significant bits, and the target's verification pass (k + 1 positions at
# once) does not round exactly like one-token decoding; where plain decoding's top two tokens are (nearly)
# tied, the other one can win. `compare_with_plain` below accepts a difference only there: at a position
# where plain decoding's top two logprobs are less than `NEAR_TIE` apart.

# %%
NEAR_TIE = 0.25  # nats: a few rounding steps of a bf16 logit of size 8..16 (each step is 0.0625 there)


def compare_with_plain(name: str, outputs: list[list[int]]) -> dict[int, int]:
    """{request: first token where `outputs` leaves plain greedy decoding}; in float32 it must be empty,
    in bf16 and fp16 every such token must be a near tie of plain decoding."""
    diverged = {}
    for i, (ids, ref) in enumerate(zip(outputs, reference)):
        d = next((j for j, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        if d is not None:
            diverged[i] = d
            print(f"{name}: request {i} leaves plain decoding at token {d}: {tok.decode([ids[d]])!r} instead of "
                  f"{tok.decode([ref[d]])!r}, where plain decoding's top two were {margins[i][d]:.4f} nats apart")
    if DTYPE == torch.float32:
        assert not diverged, f"{name}: in float32 speculation changes the speed, never the output"
    else:
        assert all(margins[i][d] < NEAR_TIE for i, d in diverged.items()), \
            f"{name}: an output left plain decoding where it was not a near tie: a bug, not rounding"
    return diverged

# %% [markdown]
# ## The drafters
#
# **A draft model.** `DraftModelProposer` runs a second, smaller model inside the same engine with the same
# parts as the target: a `ModelRunner` and a `KVCacheManager` with block tables of its own. Each round it
# catches up on the tokens the target accepted since last time, then decodes k - 1 more, one at a time.

# %%
print(DraftModelProposer.__module__, "-", inspect.getmodule(DraftModelProposer).__doc__)
print(inspect.getsource(DraftModelProposer.propose))

# %% [markdown]
# Watch both caches during a run. After each step the target's cache holds every token but the last one
# sampled, and the drafter has just proposed k drafts for the next step: its cache has run ahead over
# the tokens it drafted. Next round it is cut back to what the target accepted (the rollback) and
# overwrites the rest.

# %%
spec = LLM(speculative_model=DEFAULT_DRAFT_MODEL, num_speculative_tokens=5)
engine, drafter = spec.engine, spec.engine.runner.proposer  # the runner owns its drafter
sizes = {}
for name, runner in (("target", engine.runner), ("draft", drafter.runner)):
    cfg = runner.model_config
    sizes[name] = sum(p.numel() for p in runner.model.parameters())
    print(f"{name:6s}: {sizes[name]:,} parameters, {cfg.num_layers} layers, hidden size {cfg.hidden_size}")
print(f"the draft has {sizes['draft'] / sizes['target']:.0%} of the target's parameters")
# A draft model is worth running only if it is much smaller than the target.
assert sizes["draft"] < sizes["target"] / 4
engine.add_request("r", PROMPTS[0], GREEDY)
for _ in range(3):
    engine.step()
    req = engine.scheduler.running[0]
    shadow = drafter.shadows["r"]
    print(f"step {engine.num_steps - 1}: target cache {req.num_computed_tokens} tokens in blocks "
          f"{engine.kv.block_tables['r']}; draft cache {shadow.num_computed_tokens} tokens in blocks "
          f"{drafter.kv.block_tables['r']}; drafts for the next step {req.spec_token_ids}")
    assert req.num_computed_tokens == req.num_tokens - 1 and len(req.spec_token_ids) == 5
    assert shadow.num_computed_tokens == req.num_tokens + len(req.spec_token_ids) - 1
engine.abort_request("r")
engine.step()
# When the requests finish, both the target's and the drafter's caches are freed.
assert drafter.kv.num_free_blocks == drafter.kv.pool.num_blocks and not drafter.shadows, "both caches freed"

# %% [markdown]
# **N-gram lookup.** No model at all: find the most recent earlier occurrence of the last few tokens and
# propose what followed it. Free to run; it pays when the output repeats its context (summaries, code
# edits, quoting), and proposes nothing when there is no match.

# %%
print(inspect.getsource(NgramProposer.lookup))
ngram = NgramProposer(num_speculative_tokens=4)
story = tok.encode("Tom has a red ball. Tom likes his red ball. Tom has a red")
guess = ngram.lookup(story, 4)
print("context:", repr(tok.decode(story)), "-> drafts:", repr(tok.decode(guess)))
# The n-gram proposer drafts what followed the last earlier occurrence of the context's tail.
assert tok.decode(guess).startswith(" ball"), "what followed the last earlier 'Tom has a red'"

# %% [markdown]
# ## The verifier
#
# The target runs once over the last accepted token and the k drafts, which gives k + 1 next-token
# distributions. Greedy verification keeps drafts while each equals the target's choice at its position;
# with sampling, the rejection-sampling rule accepts draft d with probability min(1, p(d) / q(d)) and, at
# the first rejection, draws from the leftover max(0, p - q): either way every emitted token is distributed
# exactly as if the target had produced it alone.

# %%
print(inspect.getsource(rejection_sampler.verify_greedy))

# %% [markdown]
# The rule for sampling, checked numerically with the engine's own `verify_sampled`: a drafter with
# distribution q proposes one token, the target's distribution is p; whatever q is, the first token that
# comes out is distributed as p.

# %%
p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])  # target: position of the draft, then bonus
q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])  # drafter: often proposes tokens the target dislikes
gen = torch.Generator().manual_seed(0)
counts = torch.zeros(4)
n = 4000
for _ in range(n):
    d = int(torch.multinomial(q[0], 1, generator=gen))
    counts[rejection_sampler.verify_sampled(p, [d], q, gen)[0]] += 1
print("target p:       ", [round(x, 3) for x in p[0].tolist()])
print("first token out:", [round(c, 3) for c in (counts / n).tolist()])
# Rejection sampling makes the first token come out distributed as the target's p, whatever q proposed.
assert (counts / n - p[0]).abs().max() < 0.03

# %% [markdown]
# ## The example, on a real recorded step
#
# We run the three prompts with k = 5 drafts from the draft model and look through the engine's trace for
# a verification step where the target disagreed at the third draft (before any near-tie difference, so
# that plain decoding's token at that position is comparable).

# %%
start = engine.num_steps
outs = spec.generate(PROMPTS, GREEDY, use_tqdm=False)
diverged = compare_with_plain("draft k=5", [o.outputs[0].token_ids for o in outs])
steps = widgets.new_steps(engine, start)
rounds = {o.request_id: widgets.spec_rounds(steps, o.request_id) for o in outs}
comparable = [r for rs in rounds.values() for r in rs  # rounds wholly before their request's first difference
              if len(r.output_before) + len(r.new_token_ids) <= diverged.get(int(r.request_id), len(reference[0]))]
example = next((r for r in comparable if len(r.drafted) == 5 and r.num_accepted == 2), None)
if example is None:  # no exact match in this recording: the closest, a disagreement after at least one kept
    example = max((r for r in comparable if r.outcome == "correction"),
                  key=lambda r: (r.num_accepted > 0, -abs(r.num_accepted - 2)))
out = next(o for o in outs if o.request_id == example.request_id)
i = example.num_accepted
print(f"request {example.request_id}, step {example.step}: drafts {[tok.decode([t]) for t in example.drafted]}")
print(f"kept {[tok.decode([t]) for t in example.new_token_ids[:i]]}, draft {i + 1} "
      f"{tok.decode([example.drafted[i]])!r} corrected to {tok.decode([example.target_token])!r}")
position = len(example.output_before) + i
# The drafts before the correction were accepted, and the correction is the token plain decoding gives.
assert example.new_token_ids[:i] == example.drafted[:i] and example.target_token != example.drafted[i]
assert reference[int(example.request_id)][position] == example.target_token, \
    "the correction is exactly the token plain decoding produced there"

# %% [markdown]
# ## Step through it, token by token
#
# The speculation stepper replays one request from the trace. The slider picks a verification round; each
# press of **Step** reveals the target's verdict on one more token: green = draft accepted, red = the
# first rejected draft (struck out) with the target's correction, grey = drafts discarded after it, blue =
# the bonus token when every draft was accepted; `·` marks a space. **Show round** reveals a whole round at
# once; **next rejection** jumps to the next round where the target disagreed. It opens on the example above.

# %%
k_example = rounds[example.request_id].index(example)
stepper = widgets.SpeculationStepper(steps, example.request_id, tokenizer=tok,
                                     prompt_token_ids=out.prompt_token_ids)
stepper.index = k_example
stepper.show_round()
display(stepper)

# %%
outcomes = [r.outcome for rs in rounds.values() for r in rs]
print({o: outcomes.count(o) for o in ("plain", "correction", "bonus")})
# The stepper's rounds include both outcomes the prose describes: a correction and a bonus token.
assert "bonus" in outcomes and "correction" in outcomes

# %% [markdown]
# ## Equal up to rounding: what bf16 and fp16 change
#
# In float32 the cell above found no difference at all. In bf16 or fp16 it may have printed one: a request
# that leaves plain decoding at some token. Here is what the two engines saw there. Both report the
# logprobs of the top two tokens at that position: plain decoding computed them in a one-token decode step,
# the speculative engine in a verification pass over k + 1 positions.

# %%
spec_lp = spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
for i, d in diverged.items():
    seen = {"plain decoding": plain_outs[i].outputs[0].logprobs[d], "verification": spec_lp[i].outputs[0].logprobs[d]}
    for who, lp in seen.items():
        top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]
        pairs = ",  ".join(f"{tok.decode([t])!r} {x.logprob:.4f}" for t, x in top)
        print(f"request {i}, token {d}, {who:>14}: {pairs}")
if not diverged:
    print(f"in {DTYPE} no request left plain decoding: nothing to show here")

# %% [markdown]
# Where a difference shows up, plain decoding saw two tokens tied (or nearly so), and the verification pass
# saw them one rounding step apart the other way. Neither is wrong: both are the same model, computed
# with the additions done in a different order. A bf16 logit near 10 can only be 10.0, 10.0625, 10.125, ...;
# the operations that handle k + 1 positions together (attention over several query positions, the matrix
# products' blocking) sum in a different order than those handling one, the results round to different
# neighbours, and at a tie greedy decoding takes the other token. From there on the two texts differ, both
# plausible. In float32 the rounding differences are a million times smaller than the gaps between
# the top tokens, so the outputs are equal.
#
# Making the two paths round identically is called *batch invariance*: every kernel must reduce in an order
# that does not depend on how many rows are in the batch. vLLM offers it as an option
# ([docs: batch invariance](https://docs.vllm.ai/en/latest/features/batch_invariance.html); the
# [Thinking Machines post](https://thinkingmachines.ai/blog/defeating-nondeterminism-in-llm-inference/)
# explains why it costs speed). minivllm does not have such a mode, so its promise is: equal in float32, and
# in bf16/fp16 different only at near ties, which `compare_with_plain` checks.

# %% [markdown]
# ## How much faster? k = 2 .. 6 at batch 1
#
# Each configuration generates the same 3 x 40 greedy tokens, one request at a time (batch 1, where
# speculation helps most), and must produce the plain engine's tokens (up to near ties in bf16/fp16,
# checked by `compare_with_plain`). We time the whole run and,
# with a step observer (`engine.add_step_observer`) that reads the drafting time the runner reports for
# each step, the part spent drafting; the rest is the target's verification steps.


# %%
class DraftTimer:
    """A step observer: adds up the time each step's runner spent drafting (RunnerOutput.propose_seconds)."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, engine, record):
        self.seconds += record.runner_output.propose_seconds


def run_batch1(llm):
    """Warm up, then generate the prompts one at a time: (seconds, token ids, drafting seconds, target steps)."""
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    timer, before = DraftTimer(), llm.engine.num_steps
    llm.engine.add_step_observer(timer)
    t0 = time.perf_counter()
    tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    seconds = time.perf_counter() - t0
    llm.engine.remove_step_observer(timer)
    return seconds, tokens, timer.seconds, llm.engine.num_steps - before


base_s, base_tokens, _, base_steps = run_batch1(plain)
n_tokens = sum(len(t) for t in reference)
compare_with_plain("plain, one request at a time", base_tokens)
# The baseline: plain decoding runs one target step per token.
assert base_steps == n_tokens, "plain decoding: one target step per token"
rows = []
for drafter_name, k in [("draft", k) for k in range(2, 7)] + [("ngram", 4)]:
    llm = LLM(speculative_model=DEFAULT_DRAFT_MODEL if drafter_name == "draft" else "[ngram]",
              num_speculative_tokens=k, num_kv_blocks=64, trace_steps=0)
    gc.collect()  # the previous engine's memory goes now, not in the middle of the timing
    secs, tokens, draft_s, n_steps = run_batch1(llm)
    compare_with_plain(f"{drafter_name} k={k}", tokens)
    st = llm.engine.stats()
    rows.append(dict(drafter=drafter_name, k=k, seconds=secs, draft_s=draft_s, steps=n_steps,
                     accept=st["spec_acceptance_rate"], mean_len=st["spec_mean_accepted_length"],
                     speedup=base_s / secs))

print(f"plain: {n_tokens} tokens in {base_s:.2f} s = {n_tokens / base_s:.0f} tokens/s, {base_steps} target steps")
print(f"{'drafter':>7} {'k':>2} {'accept':>7} {'tokens/step':>11} {'target steps':>12} {'drafting':>9} "
      f"{'verifying':>9} {'speed-up':>8}")
for r in rows:
    print(f"{r['drafter']:>7} {r['k']:2d} {r['accept']:7.1%} {r['mean_len']:11.2f} {r['steps']:12d} "
          f"{r['draft_s']:8.2f}s {r['seconds'] - r['draft_s']:8.2f}s {r['speedup']:7.2f}x")

# %%
draft_rows = [r for r in rows if r["drafter"] == "draft"]
# Every draft length needs fewer target passes than plain decoding, and longer drafts yield more per pass.
assert all(0 <= r["accept"] <= 1 and 1 <= r["mean_len"] <= r["k"] + 1 for r in rows)
assert all(r["steps"] < base_steps for r in draft_rows), "every k needs fewer target passes than plain decoding"
assert draft_rows[-1]["mean_len"] > draft_rows[0]["mean_len"], "longer drafts: more tokens per target pass"

fig = Figure(figsize=(11, 2.8))
ax1, ax2, ax3 = fig.subplots(1, 3)
ks = [r["k"] for r in draft_rows]
ax1.plot(ks, [r["accept"] for r in draft_rows], "o-")
ax1.set_ylim(0, 1.05)
ax1.set_ylabel("acceptance rate")
ax2.plot(ks, [r["mean_len"] for r in draft_rows], "o-", label="measured")
ax2.plot(ks, [k + 1 for k in ks], ":", color="gray", label="k + 1 (all accepted)")
ax2.set_ylabel("tokens per target pass")
ax2.legend(fontsize=8)
ax3.bar(ks, [r["speedup"] for r in draft_rows], color="#4c72b0")
ax3.axhline(1, color="black", linewidth=0.8)
ax3.set_ylabel("speed-up over plain decoding")
for ax in (ax1, ax2, ax3):
    ax.set_xlabel("k (drafts per step)")
fig.suptitle("speculative decoding with the draft model, batch 1, greedy (measured on this machine)", fontsize=10)
fig.tight_layout()
widgets.show(fig)

# %% [markdown]
# ## Why the speed-up is limited here, and why speculation pays on a GPU
#
# The table splits each run's time into drafting and verifying. Compare a verification step with a
# plain decode step on this machine:

# %%
plain_step_ms = base_s / base_steps * 1e3
runner = plain.engine.runner
print(f"this machine: {runner.device} ({runner.dtype}), {os.cpu_count()} CPU cores, "
      f"torch on {torch.get_num_threads()} threads")
for r in draft_rows:
    verify_ms = (r["seconds"] - r["draft_s"]) / r["steps"] * 1e3
    print(f"k={r['k']}: a verification pass over {r['k'] + 1} positions costs {verify_ms:5.2f} ms = "
          f"{verify_ms / plain_step_ms:4.2f}x a plain step ({plain_step_ms:.2f} ms); drafting costs "
          f"{r['draft_s'] / r['steps'] * 1e3:5.2f} ms per step")

# %% [markdown]
# Speculation is worth it when checking k + 1 tokens costs about as much as producing one, and drafting is
# cheap. On a GPU, decode at batch 1 is **memory bound**: every step streams all the weights (and the KV
# cache) from memory to do a couple of operations per weight, so the arithmetic units mostly wait; scoring
# k + 1 positions instead of 1 reads the same bytes and takes about the same time, and a drafter a tenth of
# the target's size costs about a tenth of a step per draft. That is where speculation's 2-3x at batch 1
# comes from on real models.
#
# On a CPU (the machine is printed above), with a target of a few million parameters, the premise holds
# at best in part. A step of a model this small is not limited by reading its weights from memory; it is
# mostly fixed costs per layer and per operator, plus arithmetic that grows with the number of positions.
# So a pass over k + 1 positions may cost about a plain step or clearly more (the ratios above; on a
# machine shared with other programs they vary from run to run); and a draft token costs far more than
# the draft's share of the parameters (printed near the top) suggests, because the draft still runs a
# full stack of layers per token (fewer and narrower, but each with the same fixed costs). What
# speculation reliably saves is target *passes* (the "target steps" column); the wall-clock gain is
# whatever remains after paying for longer verification passes and for the drafts. That is why it is
# modest here, and why a larger k need not help: longer drafts are accepted less often, while their cost
# keeps growing. The n-gram drafter costs almost nothing, but on these stories it rarely proposes what
# the target would say (its acceptance rate above).

# %% [markdown]
# ## Exercise: the acceptance rule
#
# Write `my_verify_sampled(target_probs, draft, draft_probs, generator)`: `target_probs` is `[k + 1, vocab]`
# (the target's p at each draft position and after the last), `draft` the k drafted ids, `draft_probs` the
# drafter's q, `[k, vocab]`, or `None` for the n-gram drafter (q is then 1 on the draft). Walk the drafts:
# keep draft d with probability min(1, p(d) / q(d)) (draw `torch.rand((), generator=generator)`); at the
# first rejection append one token drawn from normalise(max(0, p - q)) and stop; if all are kept, append a
# bonus token drawn from the last row. Return the tokens to append.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(verify_sampled=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch07_verify_sampled.py`: try first.
#
# The checker tries cases with a certain answer, then runs your rule thousands of times on one step and
# compares the distribution of the first emitted token with the target's p (the rule's whole promise), and
# finally runs the engine with the embedded draft model and your rule.

# %%
import torch


def my_verify_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                      generator: torch.Generator) -> list[int]:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch07 import check_verify_sampled

check_verify_sampled(my_verify_sampled)

# %% [markdown]
# Next: [08 · Triton kernels: paged attention on the GPU](08_triton_kernels.ipynb).
