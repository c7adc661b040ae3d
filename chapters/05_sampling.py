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
# # 05 · Sampling: from logits to the next token
#
# The last step of every engine step turns each request's logits (one score per vocabulary entry) into
# one token. Greedy decoding takes the highest score; sampling draws from the softmax, reshaped by
# temperature and cut down by top-k, top-p and min-p, with a repetition penalty against what the request
# has already said. Every request in a batch carries its own settings. We use the engine's sampler
# (`minivllm/sampling/sampler.py`) on real logits captured from the model while it generates.

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
import json
import math
import textwrap

import torch
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams, widgets
from minivllm.sampling import sampler as sampler_module
from minivllm.sampling.sampler import (
    SamplingBatch,
    apply_frequency_presence_penalties,
    apply_logits_processors,
    apply_repetition_penalty,
    apply_top_k_top_p_min_p,
    processed_probs,
)
from minivllm.sampling_params import StructuredOutputsParams

llm = LLM(dtype="float32")  # exact comparisons below: bf16/fp16 round differently per batch shape (ch. 07)
tok = llm.tokenizer
print(sampler_module.__doc__)

# %% [markdown]
# ## Real logits
#
# Just before it samples, the runner hands each step's logits to its `logits_observers`. We add one for a
# generation to keep a copy of what the sampler was given, then take it out again.

# %%
recorded = []


def keep_logits(request_ids, logits):
    recorded.append(logits.detach().float().cpu().clone())


runner = llm.engine.runner
runner.logits_observers.append(keep_logits)
prompt = "Once upon a time, there was a little"
greedy_out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
runner.logits_observers.remove(keep_logits)
logits = recorded[0][0]  # step 0, the only request: the next-token scores after the prompt
print(f"{prompt!r} -> {greedy_out.outputs[0].text!r}")
print("logits:", tuple(logits.shape), "(one score per vocabulary entry)")


def top(probs, k=8):
    values, ids = probs.topk(k)
    return [(repr(tok.decode([i])), round(v, 3)) for v, i in zip(values.tolist(), ids.tolist())]


probs = logits.softmax(-1)
print(textwrap.fill(f"most likely next tokens: {top(probs)}", 100, subsequent_indent="  "))

# %% [markdown]
# ## Greedy
#
# Temperature 0 means argmax. It is what the engine picked:

# %%
assert int(logits.argmax()) == greedy_out.outputs[0].token_ids[0]
print("greedy picks", repr(tok.decode([int(logits.argmax())])))

# %% [markdown]
# ## The engine's own logprobs
#
# Ask for `logprobs=k` and every generated token comes back with its log-probability, its rank and the k
# most likely alternatives (`prompt_logprobs=k` does the same for the prompt). They are the model's own
# numbers, a log-softmax of the raw logits computed on the device for just the requests that asked, before
# temperature or any filter: what the model thought, not what the sampler then did. Here are the first four
# steps of the greedy generation above, as the engine reports them.

# %%
traced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=8), use_tqdm=False)[0]
fig = Figure(figsize=(10, 2.6))
for step, (ax, position) in enumerate(zip(fig.subplots(1, 4, sharey=True), traced.outputs[0].logprobs)):
    chosen = traced.outputs[0].token_ids[step]
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:8]
    ax.bar(range(len(ranked)), [math.exp(lp.logprob) for _, lp in ranked],
           color=["#dd8452" if t == chosen else "#4c72b0" for t, _ in ranked])
    ax.set_xticks(range(len(ranked)), [lp.decoded_token for _, lp in ranked], rotation=60, fontsize=7)
    ax.set_title(f"step {step}: picked {tok.decode([chosen])!r}", fontsize=9)
    if step == 0:
        ax.set_ylabel("probability (the model's, before sampling)", fontsize=8)
widgets.show(fig)
first = traced.outputs[0].logprobs[0]
# The logprobs the engine reports are the log-softmax of the very logits the sampler saw.
assert all(abs(lp.logprob - float(logits.log_softmax(-1)[t])) < 1e-4 for t, lp in first.items()), \
    "the logprobs are the log-softmax of the logits the sampler saw"
print("cumulative logprob of the 4 tokens:", round(traced.outputs[0].cumulative_logprob, 3))

# %% [markdown]
# ## Temperature
#
# Logits are divided by the temperature before the softmax: below 1 sharpens the distribution toward
# the top token, above 1 flattens it. The bars come from the engine's own `processed_probs` (what a
# sampling request draws from), one panel per setting, on the logits of step 0. The scale is logarithmic:
# the tail is where temperature acts most visibly, each grid line a factor of 10 in probability.

# %%
settings = [SamplingParams(temperature=t) for t in (0.3, 1.0, 2.0)]
reshaped = processed_probs(logits.expand(3, -1).clone(), SamplingBatch.build(settings, [[]] * 3, "cpu"))
fig = Figure(figsize=(9, 2.8))
axes = fig.subplots(1, 3, sharey=True)
entropy = {}
top_ids = probs.topk(8).indices
for ax, p, sp in zip(axes, reshaped, settings):
    entropy[sp.temperature] = float(-(p * p.clamp_min(1e-30).log()).sum())
    ax.bar(range(8), p[top_ids].tolist(), color="#4c72b0")
    ax.set_yscale("log")
    ax.set_ylim(1e-8, 1.5)
    ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5)
    ax.set_xticks(range(8), [tok.decode([i]) for i in top_ids.tolist()], rotation=60, fontsize=7)
    ax.set_title(f"temperature {sp.temperature}: entropy {entropy[sp.temperature]:.2f}", fontsize=9)
axes[0].set_ylabel("probability (log scale)")
widgets.show(fig)
# A higher temperature spreads the distribution: its entropy grows with the temperature.
assert entropy[0.3] < entropy[1.0] < entropy[2.0]

# %% [markdown]
# ## Top-k, top-p, min-p
#
# The filters set the scores of excluded tokens to minus infinity, so the softmax gives them nothing:
#
# * **top-k** keeps the k highest;
# * **top-p** (nucleus) keeps the smallest set of top tokens whose probability adds up to at least p;
# * **min-p** keeps tokens with at least `min_p` times the top token's probability.
#
# The engine's function takes one row per request, each with its own settings (0 / 1 / 0 switch a filter
# off). Step 0's own logits can be so sure of their top tokens that every filter keeps the same few (the
# first line below counts them): no lesson there. So the rows get those logits divided by a temperature,
# the first of a few on which the three filters keep different tokens (a temperature spreads the mass
# without reordering it, as the panels above showed). Three rows, the same logits:

# %%
for temperature in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
    spread = logits / temperature
    kept = apply_top_k_top_p_min_p(spread.expand(3, -1).clone(), top_k=torch.tensor([5, 0, 0]),
                                   top_p=torch.tensor([1.0, 0.9, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.1]))
    counts = torch.isfinite(kept).sum(-1).tolist()
    print(f"step 0's logits / {temperature}: top_k=5 keeps {counts[0]}, top_p=0.9 keeps {counts[1]}, "
          f"min_p=0.1 keeps {counts[2]} of {logits.numel()} tokens")
    if len(set(counts)) == 3:
        break
# The demo needs a temperature at which top-k, top-p and min-p keep different numbers of tokens.
assert len(set(counts)) == 3, "no temperature tried makes the three filters keep different tokens"
spread_probs = spread.softmax(-1)
sorted_probs = spread_probs.sort(descending=True).values
mass = sorted_probs.cumsum(0)
print(f"the top {counts[1]} tokens hold {mass[counts[1] - 1]:.3f} of the probability (top-p 0.9); "
      f"min-p's bar: 0.1 x {sorted_probs[0]:.3f} = {0.1 * sorted_probs[0]:.3f}")
# Each filter kept what its rule says: 5 for top-k, the smallest set reaching 0.9 for top-p, the bar for min-p.
assert counts[0] == 5
assert counts[1] == 1 or mass[counts[1] - 2] < 0.9 <= mass[counts[1] - 1] + 1e-6, "the smallest set reaching 0.9"
assert counts[2] == int((spread_probs >= 0.1 * spread_probs.max()).sum())

shown = spread_probs.topk(min(max(counts) + 4, 24)).indices  # at most 24 bars: a readable figure
fig = Figure(figsize=(10, 2.8))
axes = fig.subplots(1, 3, sharey=True)
for ax, row, name in zip(axes, kept, ("top_k=5", "top_p=0.9", "min_p=0.1")):
    colors = ["#4c72b0" if torch.isfinite(row[i]) else "#cccccc" for i in shown.tolist()]
    ax.bar(range(len(shown)), spread_probs[shown].tolist(), color=colors)
    ax.set_xticks(range(len(shown)), [repr(tok.decode([i]))[1:-1] for i in shown.tolist()], rotation=70,
                  fontsize=7)
    ax.set_title(f"{name}: keeps {int(torch.isfinite(row).sum())} (blue)", fontsize=9)
axes[0].set_ylabel(f"probability at temperature {temperature}", fontsize=8)
fig.tight_layout()
widgets.show(fig)

# %% [markdown]
# ## Repetition penalty
#
# Every token already in the prompt or the output gets its score divided by the penalty if positive,
# multiplied if negative: either way, less likely.

# %%
history = tok.encode(prompt)  # the prompt and output so far: here, just the prompt
batch = SamplingBatch.build([SamplingParams(repetition_penalty=1.5)], [history], device="cpu")
penalized = apply_repetition_penalty(logits[None].clone(), batch)[0]
seen = sorted(set(history))
for i in seen:
    name = tok.decode([i]) or tok.hf.convert_ids_to_tokens([i])[0]  # BOS decodes to ""
    print(f"{name!r:12} {float(logits[i]):7.2f} -> {float(penalized[i]):7.2f}")
unseen = torch.ones_like(logits, dtype=torch.bool)
unseen[seen] = False
# The repetition penalty only touches tokens already seen, and makes each of them less likely.
assert torch.equal(penalized[unseen], logits[unseen]) and (penalized[seen] <= logits[seen]).all()

# %% [markdown]
# In a generation, the penalty steers away from words the text has already used (count the `little`s):

# %%
for penalty in (1.0, 1.3):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, repetition_penalty=penalty),
                       use_tqdm=False)[0].outputs[0]
    print(textwrap.fill(f"repetition_penalty={penalty}: {out.text!r}", 100, subsequent_indent="    "))
    print(f"    {len(set(out.token_ids))} distinct tokens of {len(out.token_ids)}, "
          f"'little' {out.text.count('little')} times\n")

# %% [markdown]
# ## The order of the steps
#
# Some write-ups order sampling as *temperature -> top-k/top-p -> repetition penalty -> sample*. vLLM and
# transformers apply the penalty **first**, on the raw logits, and so does our sampler (its docstring,
# printed at the top, says why: it lets greedy decoding use a penalty too). The order matters: penalising
# after a top-k filter can only reorder the survivors, and with `top_k=1` it can change nothing.

# %%
params = SamplingParams(temperature=1.0, top_k=1, repetition_penalty=1.5)
history = tok.encode(prompt) + greedy_out.outputs[0].token_ids[:1]
batch = SamplingBatch.build([params], [history], device="cpu")
top1 = dict(top_k=torch.tensor([1]), top_p=torch.ones(1), min_p=torch.zeros(1))
ours = apply_top_k_top_p_min_p(apply_repetition_penalty(logits[None].clone(), batch), **top1)
last = apply_repetition_penalty(apply_top_k_top_p_min_p(logits[None].clone(), **top1), batch)
print("penalty first (ours, vLLM, transformers):", repr(tok.decode([int(ours.argmax())])))
print("penalty last:                            ", repr(tok.decode([int(last.argmax())])))
print("the two orders pick different tokens here" if int(ours.argmax()) != int(last.argmax())
      else "the two orders agree on this one")
# The order of penalty and filter matters: after top-1 filtering the penalty cannot change the pick.
assert int(last.argmax()) == int(logits.argmax()), "after top-1 filtering the penalty cannot change the pick"
assert int(ours.argmax()) == int(apply_repetition_penalty(logits[None].clone(), batch).argmax())

# %% [markdown]
# ## Seeds, and each request its own settings
#
# A draw needs randomness. A request with a `seed` takes its noise from its own generator, so it gives
# the same tokens every time, whatever else is in the batch; requests without one share the engine's
# generator. One batch can mix greedy and sampled requests.

# %%
sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=7)
alone = llm.generate([prompt], sampled, use_tqdm=False)[0].outputs[0]
mixed = llm.generate([prompt, "Hello there", prompt, "The cat"],
                     [sampled, SamplingParams(temperature=1.2, max_tokens=20),
                      SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.9, top_k=5, seed=1)],
                     use_tqdm=False)
print("seed 7, alone:      ", repr(alone.text))
print("seed 7, in a batch: ", repr(mixed[0].outputs[0].text))
print("greedy, in a batch: ", repr(mixed[2].outputs[0].text))
other_seeds = {tuple(llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=s),
                                  use_tqdm=False)[0].outputs[0].token_ids) for s in range(4)}
print(f"seeds 0-3 gave {len(other_seeds)} different continuations")
# Seeds make a request reproducible whatever its neighbours, greedy stays greedy, and different seeds differ.
assert mixed[0].outputs[0].token_ids == alone.token_ids, "a seeded request does not depend on its neighbours"
assert mixed[2].outputs[0].token_ids == greedy_out.outputs[0].token_ids, "greedy is greedy, in any batch"
assert len(other_seeds) > 1

# %% [markdown]
# ## Presence and frequency penalties
#
# OpenAI's two penalties look only at the output so far: `frequency_penalty` subtracts its value once per
# occurrence of a token, `presence_penalty` once for any token that occurred at all. (The repetition penalty
# above also counts the prompt, and divides rather than subtracts.) On a made-up output, with the engine's
# function:

# %%
history = tok.encode(prompt) + tok.hf(" little little little cat", add_special_tokens=False).input_ids
batch = SamplingBatch.build([SamplingParams(frequency_penalty=0.5, presence_penalty=0.3)], [history], "cpu",
                            num_prompt_tokens=[len(tok.encode(prompt))])
adjusted = apply_frequency_presence_penalties(logits[None].clone(), batch)[0]
for word in (" little", " cat", " dog"):
    i = tok.hf(word, add_special_tokens=False).input_ids[0]
    print(f"{word!r:9} {float(logits[i]):7.2f} -> {float(adjusted[i]):7.2f}")
little = tok.hf(" little", add_special_tokens=False).input_ids[0]
# The frequency and presence penalties subtract exactly count x 0.5 + 0.3 from a token seen three times.
assert abs(float(logits[little] - adjusted[little]) - (3 * 0.5 + 0.3)) < 1e-5

# %%
for fp in (0.0, 1.0):
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, frequency_penalty=fp),
                       use_tqdm=False)[0].outputs[0]
    print(textwrap.fill(f"frequency_penalty={fp}: {len(set(out.token_ids))} distinct tokens of "
                        f"{len(out.token_ids)}: {out.text!r}", 100, subsequent_indent="    "))

# %% [markdown]
# ## The order of the operations
#
# The engine applies them in vLLM's order: first the masks (`allowed_token_ids`, `bad_words`), then
# `min_tokens` (no EOS or stop id before that many tokens) and `logit_bias`, then the repetition, frequency
# and presence penalties; greedy rows then take the argmax, and sampling rows go through temperature, min-p,
# top-k and top-p before the draw. Structured output (next) masks the logits before all of it.

# %%
print(inspect.getsource(apply_logits_processors))

# %% [markdown]
# ## Structured output: a grammar decides what may come next
#
# With `structured_outputs` (a JSON schema, a regex, a list of choices or a grammar), every step the
# scheduler asks the request's grammar (llguidance) for a bitmask over the vocabulary: which tokens can
# continue a valid output. The runner sets the others to minus infinity before sampling, so whatever is
# drawn keeps the text valid. A step observer reads each step's mask from the scheduler's output and counts
# how many of the vocabulary's tokens the grammar still allowed.

# %%
schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99}}}
allowed_per_step = []


def count_allowed(engine, record):
    out = record.scheduler_output
    if "json" in out.grammar_rows:
        row = out.grammar_bitmask[out.grammar_rows["json"]]
        allowed_per_step.append(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in row[: (tok.vocab_size + 31) // 32]))


llm.engine.add_step_observer(count_allowed)
llm.engine.add_request("json", "Tom said:", SamplingParams(
    temperature=0.8, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)))
while llm.engine.has_unfinished_requests():
    for out in llm.engine.step():
        result = out
llm.engine.remove_step_observer(count_allowed)
ids = result.outputs[0].token_ids
for step, (n, t) in enumerate(zip(allowed_per_step, ids)):
    print(f"step {step:2d}: {n:5d} of {tok.vocab_size} tokens allowed -> {tok.decode([t])!r}")
print(result.outputs[0].text)
value = json.loads(result.outputs[0].text)
# Guided decoding's output obeys the schema, and the grammar sometimes allows one token, sometimes many.
assert set(value) == {"name", "age"} and 1 <= value["age"] <= 99 and len(value["name"]) <= 8
assert min(allowed_per_step) == 1 and max(allowed_per_step) > 100, "sometimes one way on, sometimes many"

# %% [markdown]
# That completes one request's journey: text to ids, the queue, prefill and decode over a paged KV cache,
# continuous batching, and the sampler. The chapters after the exercise make it faster (prefix caching,
# speculative decoding, GPU kernels), serve it over HTTP, run a real model, handle memory pressure, shrink
# the weights (quantization), split the model over several devices (tensor parallelism) and send each token
# through a few of many experts (mixture of experts).

# %% [markdown]
# ## Exercise: top-p filtering
#
# Write the sampler's top-p step: `my_top_p(logits, top_p)` gets `logits` `[rows, vocab]` and each row's
# `top_p` `[rows]`, and returns the logits with every token outside the row's nucleus set to `-inf`. The
# nucleus: the most likely tokens, in order, until their probability reaches `top_p`; the top token always
# stays, and a row with `top_p = 1` comes back unchanged. Hint: sort each row, take the softmax and its
# cumulative sum, decide which sorted positions to drop, then put that decision back in vocabulary order.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(top_p=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch05_top_p.py`: try first.
#
# The checker tries rows with a known answer, draws 20000 tokens through the engine's real `Sampler` with
# your filter (a statistical test against the renormalised nucleus), then runs seeded sampling requests in
# the engine, whose tokens must equal those the engine's own filter gives.

# %%
import torch


def my_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch05 import check_top_p

check_top_p(my_top_p)

# %% [markdown]
# Next: [06 · Prefix caching: computing a shared prompt once](06_prefix_caching.ipynb).
