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
# # 14 · Mixture of experts: watching the router
#
# Most large open models served today are **mixtures of experts** (MoE): Mixtral, Qwen3-MoE, DeepSeek,
# gpt-oss. Each layer's MLP is not one network but E of them, the *experts*, and a small linear layer, the
# *router*, picks k of them for each token; the token's MLP output is the sum of those k experts' outputs,
# weighted by the router. The idea is old ([Shazeer et al., 2017](https://arxiv.org/abs/1701.06538)); Mixtral
# ([Jiang et al., 2024](https://arxiv.org/abs/2401.04088)) uses E = 8, k = 2, Qwen3-30B-A3B E = 128, k = 8.
# A token then runs through a fraction of the parameters (Mixtral 8x7B: about 13 of 47 billion), so it costs
# the compute of a much smaller model, while the model as a whole holds (and has learned into) all of them.
#
# For an inference engine that changes three things, and this chapter looks at each on a real engine run:
# the batch is regrouped per expert in every layer (tokens sorted by expert, each expert's rows multiplied as
# one block); a decode step reads only the experts its tokens chose, but the memory holds every expert; and
# splitting the model over devices can cut each expert (tensor parallel) or hand out whole experts (expert
# parallel), which send different things between them. The model is `minivllm-tiny-moe`, a Qwen3-MoE this
# project trained (`data/train.py moe`, `data/README.md`): the draft model's shapes, but each layer's MLP is
# 8 experts of half the draft's width, 2 per token. It ends with an exercise: the router's top-k choice.

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
import math
import statistics

import torch
from IPython.display import HTML, display
from safetensors import safe_open

from minivllm import LLM, SamplingParams, widgets
from minivllm.config import DEFAULT_DRAFT_MODEL, DEFAULT_MOE_MODEL
from minivllm.model import moe
from minivllm.model.moe_layer import MoeFeedForward, expert_load
from minivllm.model.moe_parallel import expert_range
from minivllm.platforms import cpu_moe

# %% [markdown]
# ## The model, and how the engine records its router
#
# `LLM(DEFAULT_MOE_MODEL)` loads it like any other checkpoint: the registry maps its `config.json`'s
# `Qwen3MoeForCausalLM` to `minivllm/model/qwen3_moe.py`, whose decoder layers hold a `MoeFeedForward`
# (`minivllm/model/moe_layer.py`) where a dense model has its MLP. It runs on the CPU here, also on a GPU
# machine, so every number below is this CPU's.
#
# With `trace_steps` on, each MoE layer keeps its router's choices: a buffer of `[tokens, k]` expert ids that
# every forward pass fills (`record_choices`), which the runner turns into tokens per expert per layer
# (`expert_load`) after each step. Every step of the trace (`llm.engine.trace`, chapter 04's recording)
# then carries `expert_load[layer][expert]`: the real routing of every step the engine runs.

# %%
llm = LLM(DEFAULT_MOE_MODEL, device="cpu", trace_steps=1000)
model, config = llm.engine.runner.model, llm.engine.config
mc = config.model_config
moe_layers = [m for m in model.modules() if isinstance(m, MoeFeedForward)]
E, K = moe_layers[0].num_experts, moe_layers[0].top_k
print(f"{mc.architecture}: {mc.num_layers} layers, hidden {mc.hidden_size}, {len(moe_layers)} MoE layers of "
      f"{E} experts (each {mc.moe_intermediate_size} wide), {K} per token, renormalised: {moe_layers[0].renormalize}")
print(f"dtype {config.dtype}, device {llm.engine.runner.device}")
print(inspect.getsource(expert_load))


def recorded(engine_llm: LLM, since: int) -> list:
    """The trace's steps from step number `since` on (the engine keeps the last trace_steps)."""
    return [t for t in engine_llm.engine.trace if t.step >= since]

# %% [markdown]
# ## How a MoE layer runs
#
# `MoeFeedForward.forward` is the whole layer: the router (`gate`, a linear layer from the hidden size to E
# logits), the top-k choice (`route`, the exercise at the end), the plan, the experts, and on several
# ranks one all-reduce. The plan is `sort_by_expert`: the `[tokens, k]` choices flattened into (token, slot)
# pairs and sorted by expert with a stable sort, so that each expert's rows sit together, with `offsets`
# saying where each expert's block starts.

# %%
print(inspect.getsource(MoeFeedForward.forward))
print(inspect.getsource(moe.sort_by_expert))

# %% [markdown]
# Then the experts. `grouped_experts` (`minivllm/model/moe.py`, the readable reference) gathers the rows in
# that order, runs each expert *once* on its block (one matrix multiply per expert: the shape a grouped-GEMM
# kernel wants; on CUDA `kernels/fused_moe.py` does all the blocks in one Triton launch), and scatter-adds
# each row back to its token, weighted by the router. The cpu platform's version, `chosen_experts`, runs the
# same computation but loops only over the experts that received a row: an expert nobody chose is never
# read. That is the version this engine runs here:

# %%
print(inspect.getsource(cpu_moe.chosen_experts))
print("this engine's experts:", moe_layers[0].run_experts.__module__ + "." + moe_layers[0].run_experts.__name__)

# %% [markdown]
# ## The router's choices, token by token
#
# One prompt, prefilled in one step: after it, each layer's buffer holds the `[tokens, k]` expert ids of
# that forward pass, one row per prompt token. Each token is shown with the two experts each layer sent it
# to (the colour is the expert).

# %%
tokenizer = llm.get_tokenizer()
first = llm.engine.stats()["num_steps"]
prompt = "Once upon a time, there was a little girl named Nora. She liked to play in the garden."
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
ids = list(out.prompt_token_ids)
choices = [layer.choices[: len(ids)].tolist() for layer in moe_layers]  # [layer][token][k]
tokens = [tokenizer.decode([i]) for i in ids]
display(HTML(widgets.router_choices_html(tokens, choices)))

# %% [markdown]
# Different tokens go to different experts, and the same word often to the same ones: a router learns to
# send similar hidden states to the same place (here, after 1.1 million training tokens, without anyone
# telling it what an expert should be for). The counts of that prefill, per layer:

# %%
(prefill,) = recorded(llm, first)
for layer, counts in enumerate(prefill.expert_load):
    print(f"layer {layer}: tokens per expert {counts}   busiest / mean = {widgets.imbalance(counts):.2f}")

# %% [markdown]
# ## The load per expert per step, and its imbalance
#
# Now a batch: 16 requests from the corpus's kind of prompts, 24 new tokens each, so the first step
# prefills all of them and the others decode one token per request. The figure is drawn from `loads`, the
# engine's routing recorded at every step: one heat map per layer (experts down, steps across), and below
# it the step's **imbalance**, the busiest expert's tokens over the mean. The step waits for its busiest
# expert (the longest block of rows; across expert-parallel ranks, the rank that holds it), so 1.0 is an even
# split and E / k = 4 the worst case, every token sending one of its two rows to the same expert.

# %%
PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there", "Once upon a time",
           "The little dog", "Tom and his mom went to", "One day, a bird", "Lily had a red ball",
           "The sun was", "Max the cat", "In the forest", "My favorite food is", "The old man",
           "A little fish", "It was raining", "Sam and Anna"]
first = llm.engine.stats()["num_steps"]
batch_out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
batch_steps = recorded(llm, first)
batch_loads = [t.expert_load for t in batch_steps]  # [step][layer][expert]
widgets.show(widgets.expert_load_figure(batch_loads, title=f"{len(PROMPTS)} requests, step 0 prefills"))
decode_ratios = [widgets.imbalance(step[layer]) for step in batch_loads[1:] for layer in range(len(step))]
print(f"prefill ({batch_steps[0].num_tokens} tokens): imbalance "
      f"{[round(widgets.imbalance(c), 2) for c in batch_loads[0]]} per layer")
print(f"decode ({len(PROMPTS)} tokens per step): imbalance median {statistics.median(decode_ratios):.2f}, "
      f"max {max(decode_ratios):.2f} over {len(decode_ratios)} layer-steps")

# %% [markdown]
# The load is far from even, and not only by chance. A decode step routes just 16 tokens, a small sample,
# so some experts get several and some none; but the same experts stay busy step after step, and a few are
# almost never chosen (counted over the whole batch below). The model was trained with transformers'
# load-balancing loss ([Fedus et al., 2021](https://arxiv.org/abs/2101.03961), Switch Transformer), which
# pushes the router towards using every expert equally often *on average over training*; in 560 steps with
# a small coefficient it did not get there, and large released models are not perfectly balanced either.
# That is the first serving cost of a MoE: the batch is regrouped in every layer, and the regrouped blocks
# are uneven, so the step waits for the longest.

# %%
for layer in range(len(moe_layers)):
    totals = [sum(step[layer][e] for step in batch_loads) for e in range(E)]
    share = [n / sum(totals) for n in totals]
    rare = [e for e in range(E) if share[e] < 0.25 / E]
    print(f"layer {layer}: share of the batch's rows per expert {[f'{x:.0%}' for x in share]}; "
          f"under a quarter of an even share: experts {rare}")

# %% [markdown]
# ## Active and total parameters: what a decode step reads, what the memory holds
#
# Counted from the checkpoints' tensors (the engine's cpu layout pads some weights into tiles, which would
# blur the count): the experts' weights, everything else (attention, norms, router, the embedding shared
# with the LM head), and what one token runs through, everything else plus k of the E experts per layer.
# Beside it the draft model, a dense model of the same shapes whose MLP is as wide as two experts. Bytes are
# in the engine's dtype.

# %%
def checkpoint_parameters(path) -> dict[str, int]:
    """Parameters per tensor name, read from the checkpoint's safetensors header (no weights loaded)."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}


draft = LLM(DEFAULT_DRAFT_MODEL, device="cpu", trace_steps=1000)
itemsize = torch.tensor([], dtype=config.dtype).element_size()
moe_tensors, draft_tensors = checkpoint_parameters(DEFAULT_MOE_MODEL), checkpoint_parameters(DEFAULT_DRAFT_MODEL)
expert_params = sum(n for name, n in moe_tensors.items() if ".experts." in name)
total_params = sum(moe_tensors.values())
active_params = total_params - expert_params + expert_params * K // E
draft_params = sum(draft_tensors.values())
held = moe_layers[0].experts  # the engine's stacked experts: gate_up [E, 2I, H], down [E, H, I]
per_expert_bytes = (held.gate_up_proj[0].numel() + held.down_proj[0].numel()) * itemsize
assert per_expert_bytes * E * len(moe_layers) == expert_params * itemsize
print(f"{'':28s} {'parameters':>11s} {'MB':>7s}")
for label, n in (("MoE: all (what memory holds)", total_params), ("MoE: experts", expert_params),
                 ("MoE: active per token", active_params), ("dense draft: all", draft_params)):
    print(f"{label:28s} {n:11,d} {n * itemsize / 1e6:7.2f}")
print(f"one expert: {per_expert_bytes:,d} bytes (gate, up and down); all {len(moe_layers) * E} experts: "
      f"{expert_params * itemsize:,d} bytes")

# %% [markdown]
# The MoE holds 2.4 times the draft's parameters and runs each token through as many as the draft (the
# router and Qwen3's q/k norms add about two thousand). Memory is sized by the total: all experts stay
# loaded, because the next token may want any of them. The KV cache is the same as the draft's, since the
# attention is the same.
#
# What a step *reads* depends on the batch. One token reads its k experts per layer; a batch reads every
# expert at least one of its tokens chose, once. The decode steps of the batch above, counted from `loads`,
# and the same for one request alone:

# %%
first = llm.engine.stats()["num_steps"]
llm.generate(["Hi, my name is"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
alone = [t.expert_load for t in recorded(llm, first)][1:]  # its decode steps
dense_mlp_bytes = sum(n for name, n in draft_tensors.items() if ".mlp." in name) * itemsize
print(f"{'batch':>5s} {'experts read per layer':>23s} {'if uniform':>11s} {'expert bytes read per step':>27s} "
      f"{'of all experts':>15s}")
for batch, steps in ((1, alone), (len(PROMPTS), batch_loads[1:])):
    touched = statistics.mean(statistics.mean(widgets.experts_touched(s)) for s in steps)
    uniform = E * (1 - (1 - K / E) ** batch)
    read = statistics.mean(widgets.expert_bytes_read(s, per_expert_bytes) for s in steps)
    print(f"{batch:5d} {touched:23.2f} {uniform:11.2f} {read:27,.0f} {read / (expert_params * itemsize):15.0%}")
print(f"the dense draft reads its whole MLP every step: {dense_mlp_bytes:,d} bytes")

# %% [markdown]
# At batch 1 the MoE reads exactly the draft's MLP bytes (2 experts of half the width per layer). At batch
# 16 most experts are touched in every layer, so the step reads most of them: with uniform routing
# E (1 - (1 - k/E)^B) experts per layer, 7.9 of 8 at B = 16; the rarely chosen experts keep this model's
# count below that. This is the serving economics of MoE in one line: decode is bound by reading weights, and
# a MoE's weights per step grow with the batch up to the total, while a dense model of the same active size
# reads the same bytes at any batch. Large batches pay (nearly) the whole model's reads for each step, still
# once for all their tokens, which is why MoE serving wants large batches *and* memory for every expert.
#
# ## Decode speed against a dense model of the same active size
#
# Measured here: the same prompts, greedy, on the MoE and on the draft, after a warm-up. The figure is the
# median time of a decode step (from the engine's trace), over the steps of three runs, so one slow moment
# of a busy machine does not decide it.

# %%
def decode_ms(engine_llm: LLM, prompts: list[str], runs: int = 3) -> float:
    """Median wall milliseconds of the engine's decode-only steps, over `runs` greedy runs."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    times = []
    for _ in range(runs):
        before = engine_llm.engine.stats()["num_steps"]
        engine_llm.generate(prompts, params, use_tqdm=False)
        times += [t.duration_s for t in engine_llm.engine.trace if t.step >= before and t.scheduled
                  and all(s.kind == "decode" for s in t.scheduled)]
    return 1e3 * statistics.median(times)


speed = {(name, batch): decode_ms(engine_llm, PROMPTS[:batch])
         for name, engine_llm in (("MoE", llm), ("dense", draft)) for batch in (1, len(PROMPTS))}
print(f"{'batch':>5s} {'MoE ms/step':>12s} {'dense ms/step':>14s} {'MoE / dense':>12s}")
for batch in (1, len(PROMPTS)):
    m, d = speed["MoE", batch], speed["dense", batch]
    print(f"{batch:5d} {m:12.2f} {d:14.2f} {m / d:12.2f}")

# %% [markdown]
# The last column is the MoE's price at equal active size on this run (a median, but still this machine's,
# at this moment). A MoE is not faster than a dense model of its *active* size, and on a CPU at this size
# expect it slower: both steps are mostly fixed costs (Python, the scheduler, sampling), and the MoE adds its
# own bookkeeping to each layer (the router, the sort, a Python loop over the chosen experts, the scatter
# back), while at batch 16 it also reads several times the dense model's MLP weights (above). What a MoE buys
# is the quality of a larger model (here, 2.4x the parameters) for its active size's arithmetic per token;
# on GPUs, where large batches are cheap and kernels fuse the bookkeeping (`kernels/fused_moe.py`), that
# trade is why the largest open models are MoEs. `bench/moe_decode.py` measures decode tokens/s against
# transformers on the same checkpoint, and the expert bytes read, at batch 1 and 64.
#
# ## Two ways to split experts over devices, and what they send
#
# With several GPUs, `LLM(..., tensor_parallel_size=N)` splits a MoE layer one of two ways (both run in
# minivllm, `minivllm/model/moe_layer.py`, and give the same tokens as one rank):
#
# * **tensor parallel** (vLLM's default): every rank holds every expert, a 1/N slice of its intermediate
#   dimension. Every rank computes every token's rows on its slices; one all-reduce of `[tokens, hidden]`
#   adds the partial outputs, as for a dense MLP (chapter 13).
# * **expert parallel** (`enable_expert_parallel=True`): each rank holds E/N whole experts and computes only
#   the rows routed to them. In minivllm attention stays tensor parallel, so every rank already has every
#   token, and the combine is the same all-reduce. Deployments that also split the *batch* across ranks
#   (data-parallel attention, as DeepSeek's) must instead send each token's rows to the ranks of its
#   experts and back: two all-to-alls.
#
# Computed from the shapes (`moe_traffic`), per rank, per MoE layer, per step, for this model in its dtype
# and for Qwen3-30B-A3B's shapes (hidden 2048, k = 8) in bf16 on 8 GPUs:

# %%
cases = {}
for batch in (1, 64):
    cases[f"this model, batch {batch}, 2 ranks"] = widgets.moe_traffic(batch, mc.hidden_size, K, 2, itemsize)
for batch in (1, 64):
    cases[f"Qwen3-30B-A3B shapes, batch {batch}, 8 ranks"] = widgets.moe_traffic(batch, 2048, 8, 8, 2)
display(HTML(widgets.traffic_html(cases)))

# %% [markdown]
# Now counted, on 2 expert-parallel ranks of this CPU (`enable_expert_parallel=True`; gloo between two
# processes, as in chapter 13): rank 0's `TensorParallel` tallies what its model hands to the collectives.
# Per step there is one all-reduce per layer for attention (o_proj), one per MoE layer, and one for the
# vocabulary-parallel embedding, each of `[tokens, hidden]`: the count must equal that formula to the byte.
# The tokens should be one rank's: in float32 the two ranks only add the same partial sums in another order
# (`tests/test_moe_tensor_parallel.py` checks them against transformers); in bf16 a near-tie may fall the
# other way, so the cell counts the requests that agree rather than asserting it.

# %%
ep = LLM(DEFAULT_MOE_MODEL, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=256)
rank0_experts = [list(m.experts.experts) for m in ep.engine.runner.model.modules() if isinstance(m, MoeFeedForward)]
print(f"rank 0 holds experts {rank0_experts[0]} of every MoE layer (whole experts: "
      f"{tuple(ep.engine.runner.model.model.layers[0].mlp.experts.gate_up_proj.shape)} [experts, 2 x width, hidden])")
traffic, before = ep.engine.runner.traffic, ep.engine.stats()
traffic.reset()
greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ep_out = ep.generate(PROMPTS[:4], greedy, use_tqdm=False)
after = ep.engine.stats()
ep_tokens = sum(after[k] - before[k] for k in ("num_prefill_tokens_computed", "num_decode_tokens"))
ep_steps = after["num_steps"] - before["num_steps"]
per_step = mc.num_layers + len(moe_layers) + 1  # o_proj, the MoE layers, the embedding
print(f"{ep_steps} steps, {ep_tokens} tokens: {traffic.all_reduce_calls} all-reduces, "
      f"{traffic.all_reduce_bytes:,d} bytes handed in by rank 0 = {per_step} x hidden x {itemsize} bytes per token")
one_out = llm.generate(PROMPTS[:4], greedy, use_tqdm=False)
same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ep_out, one_out))
print(f"{same} of {len(PROMPTS[:4])} requests write the same tokens as one rank")
assert traffic.all_reduce_calls == ep_steps * per_step
assert traffic.all_reduce_bytes == ep_tokens * per_step * mc.hidden_size * itemsize
ep.shutdown()

# %% [markdown]
# The all-reduce carries one `[tokens, hidden]` tensor whatever k is; the all-to-alls carry k rows per token
# (8 for Qwen3-30B-A3B), but only for each rank's share of the batch (the figures assume the experts a rank's
# tokens choose are spread evenly over the ranks), and the attention before them needs no collective at all,
# since each rank attends its own requests. What expert parallelism changes most is *who waits*: under tensor
# parallelism every rank does an equal slice of every expert, under expert parallelism a rank does all the
# work of its experts, so the load imbalance measured above becomes imbalance between devices. The batch's
# decode steps, as if on 2 expert-parallel ranks (rank 0 holding experts 0-3, rank 1 experts 4-7:
# `expert_range`, the engine's own split):

# %%
ranks = [expert_range(E, rank, 2) for rank in range(2)]
print("experts per rank:", [list(r) for r in ranks])
per_rank = [[sum(step[layer][e] for e in r) for r in ranks] for step in batch_loads[1:] for layer in range(len(step))]
slower = [max(rows) / (sum(rows) / 2) for rows in per_rank]
print(f"rows per rank in the first decode steps (layer 0, layer 1, ...): {per_rank[:6]}")
print(f"the busier rank's rows over an even split: median {statistics.median(slower):.2f}, max {max(slower):.2f}")

# %% [markdown]
# ## Exercise: the router's top-k choice
#
# Write `my_route(router_logits, top_k, renormalize)`: `router_logits` is `[tokens, E]`; return
# `(weights, expert_ids)`, both `[tokens, top_k]`: for each token the `top_k` experts with the largest
# softmax probability (softmax over all E experts, in float32) and the weights their outputs are summed
# with. With `renormalize=True` (Mixtral; Qwen3-MoE with `norm_topk_prob`, as this model) each token's k
# weights are rescaled to sum to 1; with `renormalize=False` (Qwen2-MoE) they stay the probabilities as the
# softmax gave them. The order of the k slots is up to you.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker compares your routing with the engine's `route` on a case with a
# known answer and on random logits (8, 9 and 64 experts, every k, both rules), then runs the embedded MoE
# through the engine and, at every MoE layer of every step, gives the layer's own router logits to your
# function and the layer's own experts to your choice: each output must be the one the engine computed. The
# reference solution is `chapters/solutions/ch14_route.py`: try first.

# %%
def my_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch14 import check_route  # noqa: E402

check_route(my_route)


# %% [markdown]
# That is the last chapter. Back to [00 · a first generation](00_first_generation.ipynb) to step through the
# journey again, or on to the engine's source: every module the chapters read is listed in the README under
# "What is inside".
