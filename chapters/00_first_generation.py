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
# # 00 · A first generation, and the journey at a glance
#
# Three prompts go into `minivllm`, a small engine built the way vLLM is, and come out as text. Then we
# look at what the engine recorded while it worked: which requests ran in which step, how many tokens
# each, when KV-cache blocks were handed out and given back. Every later chapter zooms into one part of
# this journey.
#
# The model is `minivllm-tiny`, a 5.2M-parameter Llama trained by this project on simple children's
# stories; it ships inside the package, so nothing is downloaded. On a CUDA GPU (Colab:
# *Runtime -> Change runtime type -> GPU*) the engine uses it automatically; on a CPU it runs too.

# %%
# Setup: on Colab, one pip install of the repository (the engine, its embedded model, the exercises);
# anywhere else this cell does nothing.
import subprocess
import sys

REPO = "https://github.com/minivllm/minivllm"
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"minivllm[notebook] @ git+{REPO}"], check=True)

# %%
from IPython.display import display

from minivllm import LLM, SamplingParams, widgets
from minivllm.engine.journey import format_journey

# %% [markdown]
# ## Load the engine
#
# `LLM()` with no argument loads the embedded model. Loading also sizes the KV cache: the engine works
# out how many bytes one block of 16 tokens costs and how many blocks fit its memory budget
# (chapter 02 does that arithmetic by hand). It also picks its **platform** once: which code runs
# each op. `cpu` uses small C++ kernels, `cuda` Triton kernels, and `reference` the plain torch code
# the chapters print (set `MINIVLLM_PLATFORM=reference` before starting Python to run exactly that;
# chapter 08 tabulates all three).

# %%
llm = LLM()
runner = llm.engine.runner
print(f"model:     {llm.engine.config.model.name} ({runner.model_config.model_type}, "
      f"{sum(p.numel() for p in runner.model.parameters()):,} parameters)")
print(f"device:    {runner.device}, dtype {runner.dtype}, platform {runner.platform.name}")
print(f"KV cache:  {runner.num_blocks:,} blocks of {llm.engine.config.block_size} tokens")

# %% [markdown]
# ## Generate
#
# `LLM.generate` takes a list of prompts and one `SamplingParams` (the same names and defaults as
# vLLM). Temperature 0 means greedy decoding: always the most likely next token, so the output is
# reproducible. A request stops at the end-of-sequence token or after `max_tokens`.

# %%
prompts = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
params = SamplingParams(temperature=0, max_tokens=32)
outputs = llm.generate(prompts, params)

for out in outputs:
    completion = out.outputs[0]
    print(f"{out.prompt!r} -> {completion.text!r}")
    print(f"    {len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated, "
          f"finished because: {completion.finish_reason}\n")

# %%
assert [out.prompt for out in outputs] == prompts, "outputs come back in the order of the prompts"
assert all(out.finished and out.outputs[0].finish_reason in ("stop", "length") for out in outputs)
assert all(1 <= len(out.outputs[0].token_ids) <= 32 for out in outputs)
stats = llm.engine.stats()
assert stats["num_free_blocks"] == stats["num_total_blocks"], "every KV block is free again at the end"

# %% [markdown]
# ## The journey at a glance
#
# `llm.engine.trace` holds one record (`StepTrace`) per engine step. `format_journey` prints the steps
# where something happened and counts the plain decode steps in between. Read it as:
#
# * `0:prefillx6` - request `0` had 6 tokens computed in this step, all of its prompt at once (prefill);
# * `decodex1` - one new token for a request that is already running (decode);
# * `alloc 0[5]` - request `0` got KV block 5; `freed` - blocks going back to the free pool;
# * `free N/M` - free blocks after the step, of the pool's M (M depends on the memory of the machine).

# %%
steps = list(llm.engine.trace)
print(format_journey(steps))

# %% [markdown]
# What the record says, checked:
#
# * **Step 0 prefills all three prompts together.** The step's token budget (2048 by default) is far
#   larger than the 16 prompt tokens, so all three are admitted at once.
# * **Every later step is decode**: one token per running request.
# * **A finished request gives its blocks back** in the step it finishes.

# %%
first = steps[0]
assert [(e.request_id, e.kind, e.num_tokens) for e in first.scheduled] == [
    (str(i), "prefill", len(out.prompt_token_ids)) for i, out in enumerate(outputs)]
assert all(e.kind == "decode" and e.num_tokens == 1 for t in steps[1:] for e in t.scheduled)
finished_in = {rid: t.step for t in steps for rid in t.finished}
freed_in = {rid: t.step for t in steps for rid in t.freed}
assert finished_in == freed_in and len(finished_in) == 3
assert steps[-1].num_free_blocks == steps[-1].num_total_blocks
print("tokens generated per request:", {out.request_id: len(out.outputs[0].token_ids) for out in outputs})
print("engine steps:", len(steps), "= the longest output, since all three ran side by side")
assert len(steps) == max(len(out.outputs[0].token_ids) for out in outputs)

# %% [markdown]
# ## Step through it
#
# The journey stepper replays the recording: **Step** moves one engine step forward, **Reset** goes back
# to the start, the slider jumps anywhere. Each page shows the batch (who ran, prefill or decode, how
# many tokens, the token sampled), the waiting queue, blocks allocated and freed, preemptions and
# finished requests; below it the block tables and the physical block pool (only the first blocks of
# this large pool are drawn). Everything on it is read from `llm.engine.trace`.

# %%
stepper = widgets.JourneyStepper(steps, tokenizer=llm.tokenizer)
display(stepper)

# %% [markdown]
# ## Drive the engine yourself
#
# `LLM.generate` is a loop around the engine's step API: `add_request`, then `step()` until nothing is
# unfinished. Given the engine instead of a recording, the stepper runs one real `engine.step()` each
# time you press **Step** at the end of what was recorded (the button then reads **Step (live)**). Here two
# requests with our own names are queued and the cell presses Step three times; the rest is yours: press
# **Step (live)** until both have finished ("cat" gives its block back first). Once the engine has nothing
# left to run, the button is greyed out.

# %%
engine = llm.engine
engine.add_request("story", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
engine.add_request("cat", "The cat", SamplingParams(temperature=0, max_tokens=4))
live = widgets.JourneyStepper(engine, since_step=engine.num_steps)
for _ in range(3):
    live.step_button.click()
display(live)

# %% [markdown]
# Three real engine steps ran: the first admitted both requests at once, and neither has finished yet.

# %%
assert len(live.steps) == 3 and live.steps[0].waiting == []
assert {e.request_id for e in live.steps[0].scheduled} == {"story", "cat"}
assert engine.has_unfinished_requests(), "the rest is left for Step (live)"

# %% [markdown]
# Next: [01 · Tokenization and the waiting queue](01_tokenization_and_queue.ipynb).
