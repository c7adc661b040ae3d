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
# # 01 · Tokenization and the waiting queue
#
# Before the model sees a prompt, the engine turns its text into token ids, wraps it in a `Request` and
# puts it at the back of the **waiting queue**. Each step, the scheduler admits waiting requests first
# come, first served, as long as there is room. This chapter looks at both ends: the ids our tokenizer
# produces for the three example prompts, and the queue as the engine's trace recorded it.

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

from IPython.display import HTML, display

from minivllm import LLM, SamplingParams, widgets
from minivllm.core.sequence import SequenceStatus
from minivllm.tokenizer import Tokenizer

llm = LLM()
tok = llm.tokenizer  # minivllm.tokenizer.Tokenizer, a thin wrapper around transformers' AutoTokenizer

# %% [markdown]
# ## Our ids for the three prompts
#
# Introductions to LLM serving often say prompts like these come to "about 5, 7 and 2 tokens"; the exact
# ids depend on the tokenizer. Ours is a byte-level BPE (the GPT-2 / Llama-3 family) trained with the model on the
# same stories. `Ġ` in a token's name is how byte-level BPE writes a leading space.

# %%
prompts = ["Hi, my name is", "Today is a beautiful summer day", "Hello there"]
rough = [5, 7, 2]  # the rule-of-thumb counts
rows = []
for prompt, said in zip(prompts, rough):
    ids = tok.encode(prompt)
    pieces = tok.hf.convert_ids_to_tokens(ids)
    rows.append((prompt, ids, pieces, said))
    print(f"{prompt!r}\n    ids    {ids}\n    pieces {pieces}\n"
          f"    {len(ids)} tokens with BOS, {len(ids) - 1} without; the rule of thumb says about {said}\n")

# %% [markdown]
# Every prompt starts with the same id: the **BOS** (beginning of sequence) token `<s>`, which our
# tokenizer adds, as Llama's does. The model was trained with it in front of every story, so the
# engine keeps it. Its partner `</s>` (EOS) is what the model emits when a story ends; the engine stops
# a request there unless `ignore_eos=True`.

# %%
print("BOS:", tok.hf.bos_token, tok.hf.bos_token_id, "  EOS:", tok.hf.eos_token, tok.eos_token_id)
print("special tokens:", tok.hf.all_special_tokens)
assert all(ids[0] == tok.hf.bos_token_id for _, ids, _, _ in rows)
assert [len(ids) - 1 for _, ids, _, _ in rows] == [5, 6, 2], "our counts without BOS"
assert all(tok.decode(ids) == prompt for prompt, ids, _, _ in rows), "decoding gives the text back"
assert llm.engine.eos_token_id == tok.eos_token_id

# %% [markdown]
# So without BOS our counts are 5, 6 and 2: the same ballpark as the rule of thumb's 5, 7 and 2 (another
# tokenizer would split differently, and may count BOS differently).
#
# ### Why text comes out a step late sometimes
#
# Byte-level BPE can split one character over several tokens. `☕` is three UTF-8 bytes and, in our
# tokenizer, three tokens; any one of them alone decodes to the replacement character `�`. So the engine
# does not decode one token at a time: it re-decodes a small window and holds text back while it ends in
# an unfinished character.

# %%
ids = tok.encode("A cup of tea ☕ for you")
print(tok.hf.convert_ids_to_tokens(ids))
one_by_one = [tok.decode([i]) for i in ids]
print("one token at a time:", one_by_one)
print(inspect.getsource(Tokenizer._window))
print(inspect.getsource(Tokenizer.detokenize_step))

# %% [markdown]
# Fed the same tokens one at a time, the engine's detokenizer never emits `�` and gives the sentence
# back whole:

# %%
state = tok.start_detokenizer(num_prompt_tokens=1)  # pretend only BOS was the prompt
streamed = [tok.detokenize_step(ids[:k], state) for k in range(2, len(ids) + 1)]
print("what the engine streams, token by token:", streamed)
assert "\ufffd" in "".join(one_by_one) and "\ufffd" not in "".join(streamed)
assert "".join(streamed) == "A cup of tea ☕ for you"

# %% [markdown]
# This per-token work is only done when someone reads the text as it grows: a streaming client
# (`engine.step()` outputs, the server) or stop strings, which must be spotted as they appear.
# `LLM.generate` returns only finished requests, so their text is decoded once at the end
# (`Tokenizer.detokenize_rest`), to the same string: at a batch of 256, per-token decoding would cost
# the host milliseconds every step.

# %%
once = tok.detokenize_rest(ids, tok.start_detokenizer(num_prompt_tokens=1))
print("decoded once at the end:", repr(once))
assert once == "".join(streamed)

# %% [markdown]
# ### Tokenization drawn
#
# The table below shows the ☕ sentence's tokens, one column each: the piece (as the tokenizer
# names it), the id, and the raw bytes it stands for. BOS is grey; the three red columns are the bytes
# `e2 98 95` of `☕`, none of them a character on its own.

# %%
display(HTML(widgets.pieces_html(tok, ids)))
assert b"".join(widgets.token_bytes(tok, i) for i in ids[1:]) == "A cup of tea ☕ for you".encode()

# %% [markdown]
# Our tokenizer has a chat template (Llama-3 and Qwen have longer ones). `apply_chat_template` puts
# `<s>`, a role token such as `<|user|>`, a newline before the message, `</s>` after it, and
# `<|assistant|>` to ask for the reply; the role tokens are added special tokens (grey below), one id
# each however long their name. The engine's `LLM.chat` sends exactly these ids.

# %%
chat_text, chat_ids = tok.apply_chat_template([{"role": "user", "content": "What is the day after Monday?"}])
print(repr(chat_text))
display(HTML(widgets.pieces_html(tok, chat_ids)))

# %% [markdown]
# Now step the engine's incremental detokenizer token by token. Each position shows the window it
# decodes (from `prefix_offset`; the yellow token is the new one), `read_offset` (tokens before it
# are text already), and what the step emits. Press **next held-back step**: at the first two bytes of
# `☕` the window's text ends in `�`, so the step emits nothing; the third byte completes the character
# and the step emits `☕` while `read_offset` jumps three tokens. (Our small model never writes
# non-ASCII text itself, so this one runs over the sentence above with BOS as the prompt.)

# %%
coffee = widgets.DetokenizerStepper(tok, ids, num_prompt_tokens=1)
display(coffee)

# %% [markdown]
# The same stepper over a real generation from the engine: the chat prompt above, then the model's
# reply. Its text is exactly what `LLM.chat` returns, assembled from the steps' pieces.

# %%
reply = llm.generate({"prompt_token_ids": chat_ids}, SamplingParams(temperature=0, max_tokens=12))[0]
print(repr(reply.outputs[0].text))
answer = widgets.DetokenizerStepper(tok, reply.prompt_token_ids + reply.outputs[0].token_ids,
                                    num_prompt_tokens=len(reply.prompt_token_ids))
display(answer)

# %% [markdown]
# The steps' emitted pieces, joined, give exactly the text the engine returned: streaming and the
# one decode at the end agree.

# %%
assert "".join(s.emitted for s in answer.items) == reply.outputs[0].text

# %% [markdown]
# ## The waiting queue
#
# `add_request` tokenizes, validates and queues; nothing runs until `step()`. We queue the three prompts
# under readable names and look at the scheduler's queue before the first step.

# %%
engine = llm.engine
names = ["hi", "today", "hello"]
for name, prompt in zip(names, prompts):
    engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=4))
for req in engine.scheduler.waiting:
    print(f"{req.request_id:6s} {req.status.value:8s} prompt ids {req.prompt_token_ids}  "
          f"computed tokens {req.num_computed_tokens}")
assert [r.request_id for r in engine.scheduler.waiting] == names
assert all(r.status == SequenceStatus.WAITING and r.num_computed_tokens == 0 for r in engine.scheduler.waiting)
assert engine.scheduler.running == []

# %% [markdown]
# One `step()` later the queue is empty: all three were admitted into the first batch, in arrival order.

# %%
start = engine.num_steps
engine.step()
first = engine.trace[-1]
display(HTML(widgets.step_html(first, tokenizer=tok)))
assert [e.request_id for e in first.scheduled] == names and first.waiting == []
while engine.has_unfinished_requests():
    engine.step()

# %% [markdown]
# With the default limits (up to 256 sequences and 2048 tokens per step) all three were admitted at
# once. To see the queue at work, we make room scarce: `max_num_seqs=2` lets at most two requests run
# at a time. `hello` arrives third, so it waits until one of the first two has finished, and when it is
# admitted, the request still running is served first: **decode before new prefills**, so streams that
# are under way stay smooth. (`ignore_eos=True` and different `max_tokens` fix how long each runs.)

# %%
small = LLM(max_num_seqs=2, num_kv_blocks=16)  # a fixed pool: the first engine may fill a GPU
lengths = {"hi": 4, "today": 8, "hello": 4}
for name, prompt in zip(names, prompts):
    small.engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=lengths[name], ignore_eos=True))
while small.engine.has_unfinished_requests():
    small.engine.step()
steps = list(small.engine.trace)
widgets.show(widgets.timeline_figure(widgets.timeline(steps), "max_num_seqs=2: hello waits for a free seat"))

# %% [markdown]
# The facts, read from the trace: `hello` waits at the head of the queue in steps 0-3; `hi` finishes
# in step 3 (its 4 tokens: one from the prefill, three decodes); in step 4 `today`'s decode is scheduled
# before `hello`'s prefill.

# %%
waited = [t.step for t in steps if "hello" in t.waiting]
finished = {rid: t.step for t in steps for rid in t.finished}
admitted = next(t for t in steps if any(e.request_id == "hello" for e in t.scheduled))
print("hello waiting after steps:", waited)
print("finished in step:", finished)
print("step", admitted.step, "schedules:", [(e.request_id, e.kind) for e in admitted.scheduled])
assert [e.request_id for e in steps[0].scheduled] == ["hi", "today"] and steps[0].waiting == ["hello"]
assert waited == [0, 1, 2, 3] and finished["hi"] == 3
assert admitted.step == 4 and [(e.request_id, e.kind) for e in admitted.scheduled] == [
    ("today", "decode"), ("hello", "prefill")]
assert max(len(t.running) for t in steps) == 2

# %% [markdown]
# Step through the same recording: the page lists the waiting queue after each step, in
# first-come-first-served order.

# %%
stepper = widgets.JourneyStepper(steps, tokenizer=small.tokenizer, max_blocks=16)
stepper.index = 4
display(stepper)

# %% [markdown]
# First come, first served is one policy among several a scheduler can use: shortest job first (needs
# a guess of each output's length), round-robin, and priorities. `minivllm`'s scheduler does FCFS for
# admission and puts a preempted request back at the *head* of the queue (chapter 04).

# %% [markdown]
# ## Exercise: first come, first served
#
# The scheduler keeps waiting requests in a `deque` and admits from its head (`waiting[0]`). Where a request
# goes when it arrives, or when it is preempted and comes back, *is* the policy. Write that rule:
# `my_enqueue(waiting, request, preempted)` puts `request` into `waiting` (in place). Under FCFS a new
# request joins the tail; a preempted one (`preempted=True`) is older than everyone waiting, so it goes back
# to the head, or later arrivals would overtake it.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(enqueue=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch01_enqueue.py`: try first.
#
# The checker runs your rule inside the real engine on random workloads (generated by `hypothesis`) with pools
# so small that requests get preempted, and checks after every step that nobody was admitted ahead of a
# request that arrived earlier, and that every request finishes.

# %%
from collections import deque


def my_enqueue(waiting: deque, request, preempted: bool) -> None:
    raise NotImplementedError  # your code here: waiting.append / waiting.appendleft


# %%
from minivllm.exercises.ch01 import check_enqueue

check_enqueue(my_enqueue)

# %% [markdown]
# Next: [02 · The KV cache: prefill, decode, and what a block costs](02_kv_cache.ipynb).
