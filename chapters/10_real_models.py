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
# # 10 · A real model
#
# Everything so far ran on `minivllm-tiny`, the 5M-parameter model this project trains itself. Here the
# same engine loads a real pretrained model by its Hugging Face Hub id, exactly as you would write it for
# vLLM: `LLM("HuggingFaceTB/SmolLM2-135M-Instruct")`. We look at what changes with a real checkpoint (a
# vocabulary padded past its tokenizer, a byte-level tokenizer, a chat template, several end-of-sequence
# ids), what its KV blocks cost, how many fit a Colab T4, and how fast minivllm is next to `transformers`
# on the device at hand.
#
# On Colab with a GPU the model is downloaded once (about 270 MB). Where the Hub cannot be reached (no
# network, or `HF_HUB_OFFLINE=1`, as in this project's tests) the notebook says so and runs the very same
# cells on the embedded model.

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

from minivllm import LLM, SamplingParams, widgets
from minivllm.core.kv_sizing import gpu_kv_budget, kv_bytes_per_block, kv_bytes_per_token, num_blocks_for_budget
from minivllm.engine.journey import format_journey

# %% [markdown]
# ## Load it by its Hub id
#
# `LLM(model)` takes a local directory or a Hub repo id. An id is resolved with `huggingface_hub` into the
# normal Hugging Face cache (safetensors, config and tokenizer files only), so a model downloaded once, by
# minivllm, vLLM or transformers, is not downloaded again. `revision=`, `download_dir=` and `HF_HUB_OFFLINE`
# work as they do for vLLM. If anything fails, the error names the id and says what went wrong.

# %%
HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # Llama family: 30 layers, 9 heads / 3 KV heads, 135M parameters

try:
    llm = LLM(HUB_MODEL, max_model_len=2048, max_num_seqs=64)
    source = f"{HUB_MODEL}, from the Hugging Face Hub"
except ValueError as e:  # offline, not cached, or no network: the same cells on the embedded model
    print(f"Could not load {HUB_MODEL}:\n  {e}\nSo this notebook continues with the embedded model.\n")
    llm = LLM(max_num_seqs=64)
    source = "minivllm-tiny, the embedded model (offline fallback)"
engine, runner = llm.engine, llm.engine.runner
mc, tok = runner.model_config, llm.get_tokenizer()
num_params = sum(p.numel() for p in runner.model.parameters())
print(f"model:  {source}")
print(f"        {mc.model_type}, {num_params:,} parameters, {mc.num_layers} layers, hidden {mc.hidden_size}, "
      f"{mc.num_heads} heads / {mc.num_kv_heads} KV heads of {mc.head_dim}")
print(f"device: {runner.device}, dtype {runner.dtype}; max_model_len {engine.config.max_model_len}")

# %% [markdown]
# ## Lazy loading: ready before the weights are
#
# Loading reads every tensor, lays it out for its kernels and only then returns. With `lazy_loading=True`
# the decoder layers are built on torch's *meta* device (shapes, no memory) and each one is read from the
# checkpoint the first time a step runs it (`minivllm/model/lazy_loading.py`): the engine is ready once the
# config, tokenizer, embeddings and KV cache are, and the first request pays for the weights. Below the same
# checkpoint loads both ways; the bytes are counted from the parameters that exist, before and after the
# first request. (On a GPU the engine's memory-profiling step already runs every layer while it starts, so
# there lazy loading saves nothing; `bench/lazy_loading.py` measures whole processes, cold.)

# %%
def allocated_mib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta) / 2**20


path = engine.config.model
for lazy in (False, True):
    start = time.perf_counter()
    fresh = LLM(path, lazy_loading=lazy, max_num_seqs=8, num_kv_blocks=256)
    ready = time.perf_counter() - start
    model = fresh.engine.runner.model
    before = allocated_mib(model)
    start = time.perf_counter()
    fresh.generate(["The weights arrive"], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - start
    print(f"lazy_loading={lazy!s:5}: LLM() {ready:5.2f} s with {before:7.1f} MiB of weights, "
          f"first token {first:5.2f} s later, then {allocated_mib(model):7.1f} MiB")
    del fresh, model

# %% [markdown]
# The lazy engine starts with only the embeddings and the output head in memory; its first request reads
# and lays out every layer, so it takes longer than the eager engine's, and every later step is the same.
# (The seconds depend on this machine, its disk and how busy it is; the mebibytes do not.) Serving several engines
# from one copy of the weights is the other half of this story: `LLM(..., data_parallel_size=2)` runs two
# engines, each with its own scheduler and KV cache, which map the same weight file read-only, so the page
# cache holds the bytes once (README, "Data parallelism"; `bench/data_parallel.py` measures each process's
# proportional share).

# %% [markdown]
# ## What a real checkpoint brings
#
# **The vocabulary.** A model's embedding matrix often has more rows than its tokenizer has tokens: it is
# padded to a multiple of 64 or 128 for faster matrix multiplies (Qwen2's config says 151,936 while its
# tokenizer has 151,646). A model can still sample such an id; it has no text, and like vLLM we decode it
# to nothing rather than fail.

# %%
print(f"model vocabulary {mc.vocab_size:,}; tokenizer {len(tok):,} tokens; "
      f"{mc.vocab_size - len(tok):,} ids without a token string")
assert mc.vocab_size >= len(tok)

# %% [markdown]
# **The tokenizer.** Real tokenizers are byte-level BPE: a word may be one token, and an accented letter or
# an emoji may be split across several tokens, none of which is valid text alone. That is why the engine
# detokenizes a window of recent tokens and holds back text that ends inside a character (chapter 01).

# %%
text = "Paged attention is naïve? Not at all 🙂"
ids = tok(text, add_special_tokens=False).input_ids
pieces = [tok.decode([i]) for i in ids]
print(f"{len(ids)} tokens:", pieces)
print("decoded alone, some tokens are not text:", [p for p in pieces if "\ufffd" in p])
assert tok.decode(ids) == text

# %% [markdown]
# **The chat template and the end-of-sequence ids.** An instruct model expects its conversation format,
# which the tokenizer's chat template writes; `LLM.chat` applies it. A model may also name several ids that
# end a reply (`generation_config.json`: end of text, end of turn): the engine stops at any of them.

# %%
conversation = [{"role": "user", "content": "What is the capital of France?"}]
rendered, chat_ids = llm.tokenizer.apply_chat_template(conversation)
print(rendered)
print(f"{len(chat_ids)} tokens; end-of-sequence ids: {engine.eos_token_ids} = "
      f"{[tok.convert_ids_to_tokens(i) for i in engine.eos_token_ids]}")
reply = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
print("reply:", repr(reply.outputs[0].text), "|", reply.outputs[0].finish_reason)
assert reply.prompt == rendered

# %% [markdown]
# ## The journey on a real model
#
# The same three prompts as chapter 00, now through this model. The trace shows the same structure (one
# prefill step, then decode steps, blocks handed out and returned), with this model's token counts.

# %%
prompts = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
for out in outputs:
    print(f"{out.prompt!r} ({len(out.prompt_token_ids)} tokens) -> {out.outputs[0].text!r}")
steps = [t for t in engine.trace if t.step >= engine.num_steps - max(len(o.outputs[0].token_ids) for o in outputs)]
print(format_journey(steps, max_lines=12))
display(HTML(widgets.block_table_html(steps[0])))
assert steps[0].num_prefill_tokens == sum(len(o.prompt_token_ids) for o in outputs)
assert steps[-1].num_free_blocks == steps[-1].num_total_blocks

# %% [markdown]
# ## What its KV blocks cost, and how many fit a T4
#
# The formula of chapter 02, on this model's config: 2 (K and V) x layers x block size x KV heads x head
# size x bytes per element. A Colab T4 has about 15 GiB; the engine takes 90% of it
# (`gpu_memory_utilization`), minus the weights (in fp16, the T4's half type: it has no bf16) and the
# activation peak it measures with one profiling pass (left out of this estimate).

# %%
fp16 = 2
per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, fp16)
per_block = kv_bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, fp16)
t4_total, weights = 15 * 2**30, num_params * fp16
t4_blocks = num_blocks_for_budget(gpu_kv_budget(t4_total, 0.9, weights), per_block)
print(f"fp16 KV: {per_token / 1024:.1f} KiB per token, {per_block / 2**20:.2f} MiB per 16-token block")
print(f"T4: 0.9 x 15 GiB - {weights / 2**30:.2f} GiB of weights -> about {t4_blocks:,} blocks "
      f"= {t4_blocks * 16:,} tokens of context in flight ({t4_blocks * 16 // engine.config.max_model_len:,} "
      f"full {engine.config.max_model_len}-token sequences)")
print(f"this engine, here: {runner.num_blocks:,} blocks of {runner.bytes_per_block / 2**20:.2f} MiB "
      f"({runner.dtype})")
assert per_block == 16 * per_token and t4_blocks > 0

# %% [markdown]
# ## minivllm next to transformers, on this device
#
# Both run the same model in the same dtype on the same device, greedy, 16 prompts of equal length, 48 new
# tokens each; transformers' `generate` takes them as one batch that needs no padding. Greedy means both do
# identical arithmetic per token, so their tokens should agree (exactly in fp32; in half precision a near-tie
# can break the other way after a few tokens, because the two compute in different orders).
#
# This is transformers' best case: equal lengths, everything known up front, nobody arriving or leaving.
# minivllm's advantages (no padding, finished requests leaving, new ones joining, CUDA graphs on a GPU) show
# with mixed lengths and arrivals (chapter 04, and `bench/` for the measured ratios); on a tiny model on a CPU
# its per-step bookkeeping can even cost more than it saves. The figures below are whatever this device says.

# %%
from transformers import AutoModelForCausalLM

N, NEW = 16, 48
base = tok("Once upon a time, in a small village by the sea, there lived", add_special_tokens=False).input_ids
batch = [base + [base[i % len(base)]] for i in range(N)]  # equal lengths: transformers needs no padding
greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in batch[:2]], greedy, use_tqdm=False)  # warm-up
sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
t0 = time.perf_counter()
ours = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
sync()
ours_s = time.perf_counter() - t0

hf = AutoModelForCausalLM.from_pretrained(engine.config.model, dtype=runner.dtype).to(runner.device).eval()
inputs = torch.tensor(batch, device=runner.device)
with torch.inference_mode():
    hf.generate(inputs[:2], max_new_tokens=4, do_sample=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    theirs = hf.generate(inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    sync()
hf_s = time.perf_counter() - t0
same = sum(o.outputs[0].token_ids == theirs[i, len(batch[i]):].tolist() for i, o in enumerate(ours))
print(f"minivllm:     {N * NEW / ours_s:8.0f} output tok/s ({ours_s:.2f} s)")
print(f"transformers: {N * NEW / hf_s:8.0f} output tok/s ({hf_s:.2f} s)")
print(f"ratio {hf_s / ours_s:.2f}x on {runner.device} ({runner.dtype}); identical greedy tokens in {same}/{N} requests")
if runner.dtype == torch.float32:
    assert same == N, "in fp32 the two engines agree token for token"
del hf

# %% [markdown]
# ## What is supported
#
# The list below is not written by hand: it is read from the engine's own registries, and each refusal is
# the engine's own `ValueError`, raised here from the same checks `LLM(...)` runs before any weight is read.
# The model families come from the loader's `SUPPORTED` (a `config.json`'s `model_type`), the weight
# formats from what `quantization=` accepts (chapter 12 teaches them), and tensor parallelism is chapter 13's.

# %%
import json
import tempfile
import textwrap
from pathlib import Path

from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.loader import SUPPORTED, checkpoint_tensors, read_model_config
from minivllm.quantization import ACCEPTED, resolve_quantization

print("model_type (config.json):", ", ".join(SUPPORTED))
print("quantization=:           ", ", ".join(["None", *ACCEPTED]), "(chapter 12)")
print("tensor_parallel_size:    ", EngineArgs.tensor_parallel_size, "by default, more ranks in chapter 13")


def refusal(action, where: str = "") -> str:
    """The engine's own message for something it does not do, wrapped to the page (an action that
    succeeds would make this list wrong, so it stops the chapter)."""
    try:
        action()
    except ValueError as error:
        message = str(error).replace(where, "<tmp>") if where else str(error)
        return textwrap.fill("refused: " + message, 100, subsequent_indent="    ")
    raise AssertionError("the engine accepted it")


with tempfile.TemporaryDirectory() as tmp:
    other = Path(tmp) / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    print("\n" + refusal(lambda: read_model_config(other), tmp))
    bin_only = Path(tmp) / "bin-only"
    bin_only.mkdir()
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    print(refusal(lambda: next(checkpoint_tensors(bin_only, engine.config.model_config)), tmp))
print(refusal(lambda: EngineArgs(pipeline_parallel_size=2)))
print(refusal(lambda: resolve_quantization("fp8", None, is_gguf=False, where="this model")))

# %% [markdown]
# ## Model families: the registry
#
# Which class builds a checkpoint is decided by one table, `minivllm/model/registry.py`: config.json's
# `architectures` name maps to a module under `minivllm/model/`, one per family. Most families are Llama's
# decoder with other options read from their config (a q/k/v bias, q/k norms, a sliding window, experts);
# Gemma 3 (`gemma3.py`) brings its own decoder layer, built from the same attention and MLP: four norms a layer
# that multiply by (1 + weight), GeGLU instead of SwiGLU, an embedding scaled by sqrt(hidden), and layers of two
# kinds, *local* ones that attend within a sliding window and rotate with their own rope base, and every sixth
# a *global* one that sees the whole context. A window limits what a layer looks back, not the length: a prompt
# may be longer than it, and where every layer slides (Mistral v0.1, the Qwen2/3 layers from `max_window_layers`
# on, a Gemma 3 whose layers are all local) the blocks the window has passed go back to the pool. The loader,
# runner and engine never name a family.

# %%
from minivllm.model.registry import ARCHITECTURES

for name, (module, _) in ARCHITECTURES.items():
    print(f"{name:22} minivllm/model/{module}.py")

# %% [markdown]
# A random tiny Gemma 3, made here with transformers (2 local layers, 1 global, a 4-token window), loads like
# any checkpoint; each layer's window comes from its config, and float16 is refused (Gemma's activations
# outgrow its range; bfloat16 or float32 run it).

# %%
import transformers

with tempfile.TemporaryDirectory() as tmp:
    tiny_gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]))
    tiny_gemma.save_pretrained(tmp)
    gemma_llm = LLM(tmp, dtype="float32", num_kv_blocks=32)
    for i, layer in enumerate(gemma_llm.engine.runner.model.model.layers):
        window = layer.sliding_window
        print(f"layer {i}: " + (f"local, window {window}" if window else "global, the whole context"))
    gemma_out = gemma_llm.generate([{"prompt_token_ids": list(range(1, 20))}],
                                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print("19-token prompt, 8 tokens out:", gemma_out[0].outputs[0].token_ids)
    gemma_llm.shutdown()
    print(refusal(lambda: LLM(tmp, dtype="float16", num_kv_blocks=32), tmp))

# %% [markdown]
# ## A mixture of experts from the Hub
#
# Mixtral and Qwen3-MoE checkpoints load the same way (chapter 14 looks inside one, offline, on the embedded
# `minivllm-tiny-moe`). The released ones are large (Mixtral 8x7B holds 47 billion parameters, about 94 GB in
# bf16), so the example here is a small community model: `Isotonic/TinyMixtral-4x248M-MoE`, four TinyMistral
# 248M fine-tunes merged into one Mixtral with mergekit (4 experts, 2 per token, about 0.7 billion parameters,
# a 2.8 GB download in float32). It fits a Colab T4 beside the model above; offline the cell says so and
# moves on.

# %%
HUB_MOE = "Isotonic/TinyMixtral-4x248M-MoE"  # MixtralForCausalLM: 4 experts, 2 per token

try:
    moe_llm = LLM(HUB_MOE, max_model_len=1024, max_num_seqs=8)
except ValueError as e:  # offline, not cached, or no network
    print(f"Could not load {HUB_MOE}:\n  {e}\nChapter 14 runs the embedded mixture of experts offline.")
else:
    moe_mc = moe_llm.engine.runner.model_config
    print(f"{moe_mc.architecture}: {moe_mc.num_layers} layers, {moe_mc.num_experts} experts of "
          f"{moe_mc.moe_intermediate_size}, {moe_mc.num_experts_per_tok} per token")
    moe_out = moe_llm.generate(["The three primary colors are"], SamplingParams(temperature=0, max_tokens=32),
                               use_tqdm=False)
    print(repr(moe_out[0].outputs[0].text))
    moe_llm.shutdown()
    del moe_llm

# %% [markdown]
# ## Exercise: which tokens become text
#
# Write the detokenizer's rule `my_keep_token(token, is_special, skip_special_tokens)`: `token` is a token's
# string, or `None` for an id past the tokenizer's vocabulary (a padded embedding row, which a model can
# sample); return whether it goes into the text. An id without a token decodes to nothing, never an error;
# special tokens go in only when `skip_special_tokens` is False.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your rule into the engine's tokenizer through its documented
# hook, `LLM(hooks=EngineHooks(keep_token=...))` (`minivllm.hooks`; nothing is patched), streams token ids
# through the engine's incremental detokenizer with padded ids and special tokens among them, and runs a
# generation; every piece of text must equal the engine's own. It says *passed*, *not attempted*, or what
# failed, in plain words. The reference solution is `chapters/solutions/ch10_keep_token.py`: try first.

# %%
def my_keep_token(token: str | None, is_special: bool, skip_special_tokens: bool) -> bool:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch10 import check_keep_token

check_keep_token(my_keep_token)

# %% [markdown]
# Next: [11 · Memory pressure](11_memory_pressure.ipynb).
