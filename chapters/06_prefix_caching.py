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
# # 06 · Prefix caching: computing a shared prompt once
#
# Many requests start the same way: a system prompt, the same few-shot examples, the earlier turns of a
# conversation. Their keys and values are the same too, so there is no need to compute and store them
# again. With **automatic prefix caching** the engine names every *full* block of 16 tokens by a hash of
# its tokens and of everything before it; a new request whose prompt starts with blocks the cache already
# holds maps those physical blocks into its own block table (read-only, shared, reference count + 1) and
# computes only its diverging suffix, in new blocks of its own. When a request finishes, its blocks go back
# to the free queue, but a block that holds a hashed prefix keeps its contents, so later users can still
# find it until memory pressure makes the engine reuse it.

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
import statistics
import time

import torch
from IPython.display import display
from matplotlib.figure import Figure

from minivllm import LLM, SamplingParams, widgets
from minivllm.core.block_hash import extend_block_hashes, hash_block
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager

if not torch.cuda.is_available():
    # A model this small gains little from a second CPU thread, and one thread keeps the timings below
    # steady when other programs share the machine.
    torch.set_num_threads(1)

llm = LLM(num_kv_blocks=48)  # a small pool, so the block-table viewer below can draw all of it
tok, kv = llm.tokenizer, llm.engine.kv
BS = llm.engine.config.block_size
print(f"block size {BS} tokens; {kv.pool.num_blocks} blocks; prefix caching on: {kv.enable_prefix_caching}")


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def words(text):
    """Token ids of a piece of text to append to a prompt: without the BOS token the tokenizer puts first."""
    return tok.hf(text, add_special_tokens=False).input_ids


# %% [markdown]
# ## A block's name is its whole past
#
# `hash_block(parent_hash, tokens)` names a full block by its 16 tokens *and* its parent's hash, which
# in turn names the parent's tokens and its parent's, back to the start of the sequence. So two blocks
# with equal hashes hold equal tokens at equal positions after equal prefixes: exactly the condition for
# their keys and values to be equal (a token's K and V depend on every token before it). The hash is
# SHA-256, so two different prefixes never share a name in practice (Python's own `hash()` would let
# them: `hash(-1) == hash(-2)`), and a request can never read another prefix's K/V by accident.
#
# `extend_block_hashes` walks a sequence's full blocks, chaining each name to the one before (`hash_fn`,
# which is `hash_block` unless a hook replaces it). The engine keeps the list on each request and extends it
# only by blocks that filled up since, so every block is hashed once in its request's life. `hash_block`
# itself is this chapter's exercise; the engine's own is printed after it.

# %%
print(inspect.getsource(extend_block_hashes))
SYSTEM = ("You are a kind storyteller. You tell short and happy stories for little children about animals, "
          "friends and family. Every story has a beginning, a middle and an end. Use simple words.")
system_ids = tok.encode(SYSTEM)
n_full = len(system_ids) // BS
print(f"system prompt: {len(system_ids)} tokens = {n_full} full blocks + {len(system_ids) % BS} tokens")


def chain(ids):
    """The hash of every full block of `ids`, each chained to the one before (the engine's own helper)."""
    return extend_block_hashes([], ids, BS)


a = chain(system_ids + words(" Tell me a story about a brave little dog who lost his red ball."))
b = chain(system_ids + words(" Tell me a story about a sleepy cat and a big yellow moon."))
for i, (ha, hb) in enumerate(zip(a, b)):
    print(f"block {i}: {ha.hex()[:8]} {hb.hex()[:8]} {'same' if ha == hb else 'different'}")
# Two prompts with the same system prompt give its full blocks the same hashes.
assert n_full >= 3 and a[:n_full] == b[:n_full], "the system prompt's full blocks get the same names"

# %% [markdown]
# The same 16 tokens in a different place, or after a different start, get a different name: block 1 of
# the system prompt, hashed as if it were block 0, or after a changed first block, is not found.

# %%
block1 = system_ids[BS : 2 * BS]
other_block0 = tok.encode("Once upon a time there was a little dog named Max who liked to run and play.")[:BS]
print("block 1 after block 0:         ", hash_block(a[0], block1) == a[1])
print("block 1 with no parent:        ", hash_block(None, block1) == a[1])
print("block 1 after another block 0: ", hash_block(hash_block(None, other_block0), block1) == a[1])
# A block's hash depends on the block before it: the same tokens after a different prefix get another name.
assert len(other_block0) == BS and other_block0 != system_ids[:BS]
assert hash_block(a[0], block1) == a[1]
assert hash_block(None, block1) != a[1] and hash_block(hash_block(None, other_block0), block1) != a[1]

# %% [markdown]
# On admission the scheduler asks the manager for the longest cached prefix. It walks the new prompt's
# blocks, hashing as it goes, and stops at the first name the pool does not know:

# %%
print(inspect.getsource(KVCacheManager.find_cached_prefix))

# %% [markdown]
# ## One system prompt, several users
#
# A first user warms the cache (as the first request after a deployment would). Then four users send the
# same system prompt with their own question. We record the engine's steps and look at the first one.

# %%
questions = [" Tell me a story about a brave little dog.", " Tell me a story about a sleepy cat.",
             " Tell me a story about a happy frog.", " Tell me a story about two friends at the park."]
llm.generate({"prompt_token_ids": system_ids}, greedy(1), use_tqdm=False)  # the first user
engine = llm.engine
start = engine.num_steps
stats_before = engine.stats()
users = {f"user{i}": system_ids + words(q) for i, q in enumerate(questions)}
for rid, ids in users.items():
    engine.add_request(rid, ids, greedy(24))  # enough to fill each user's last block and open another
while engine.has_unfinished_requests():
    engine.step()
run = widgets.new_steps(engine, start)
first = run[0]
print("re-used from the cache:", first.cache_hits)
print("newly allocated:       ", first.allocated)
print("shared blocks (id: ref count):", first.shared_blocks)

# %%
shared_ids = first.cache_hits["user0"]
# Every user maps the same physical blocks for the shared prefix, each one referenced by all users.
assert all(first.cache_hits[rid] == shared_ids for rid in users), "every user maps the same physical blocks"
assert len(shared_ids) == n_full and all(first.shared_blocks[b] == len(users) for b in shared_ids)
own = [b for blocks in first.allocated.values() for b in blocks]
# Where the users' prompts diverge, each gets new blocks of its own.
assert len(own) == len(set(own)) and not set(own) & set(shared_ids), "each diverging suffix gets new blocks"
for rid, ids in users.items():
    assert first.block_tables[rid][:n_full] == shared_ids
    assert len(first.allocated[rid]) == -(-len(ids) // BS) - n_full, "only the suffix is allocated"

# %% [markdown]
# ## The block-table viewer
#
# Shared blocks are hatched: in the block tables (top) the same physical id appears in every user's first
# columns, and in the pool (bottom) each shared block is grey with its reference count (`x4`). Most decode
# steps change no block: **next block change** jumps to the steps where a user's output fills its last
# block and a new one is allocated, and, at the end, to where every block returns to the free queue.

# %%
viewer = widgets.BlockTableViewer(run, block_size=BS)
display(viewer)

# %%
cells = widgets.pool_cells(viewer.current)
shared_cells = [c for c in cells if c.is_shared]
print("drawn shared:", [(c.block_id, c.ref_cnt) for c in shared_cells])
# The viewer draws exactly the shared blocks, with their reference counts and owners.
assert [c.block_id for c in shared_cells] == sorted(shared_ids)
assert all(c.ref_cnt == len(users) and c.owners == list(users) for c in shared_cells)
grew = {rid for t in run[1:] for rid in t.allocated}
# Every user's output grew past a block boundary, so each allocated during decode.
assert grew == set(users), "every user's output crossed a block boundary"

# %% [markdown]
# ## The hit rate, from the engine's own counters
#
# `stats()` counts every prompt token looked up in the cache (`prefix_cache_queries`) and how many were
# found (`prefix_cache_hits`). For these four users:

# %%
stats = engine.stats()
queries = stats["prefix_cache_queries"] - stats_before["prefix_cache_queries"]
hits = stats["prefix_cache_hits"] - stats_before["prefix_cache_hits"]
computed = stats["num_prefill_tokens_computed"] - stats_before["num_prefill_tokens_computed"]
print(f"prompt tokens {queries}, found in the cache {hits} ({hits / queries:.1%}), computed {computed}")
print(f"since the engine started (first user included): hit rate {stats['prefix_cache_hit_rate']:.1%}")
# The engine's counters agree: every full block of the prefix was a hit, and hits were not recomputed.
assert queries == sum(len(ids) for ids in users.values()) and hits == len(users) * n_full * BS
assert computed == queries - hits, "the shared prefix was not recomputed"
assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hits"] / stats["prefix_cache_queries"]

# %% [markdown]
# ## After the users leave, the prefix stays
#
# Every block is back in the free queue, but the system prompt's blocks still carry their hashes: they
# are *evictable* cached blocks, free to be handed out, yet found by the next user as long as nobody has
# taken them. The next user proves it.

# %%
pool = kv.pool
# After the users finish, every block is free again and no table remains.
assert run[-1].num_free_blocks == pool.num_blocks and kv.block_tables == {}
still = [pool.lookup(h) for h in a[:n_full]]
print("system prompt blocks still cached (free, but holding their K/V):", still)
# Freed blocks keep their K/V: the system prompt's blocks can still be found by hash.
assert still == shared_ids
newcomer = system_ids + words(" Tell me a story about a big red bus.")
later = llm.generate({"prompt_token_ids": newcomer}, greedy(12), use_tqdm=False)[0]
print(f"a later user: {later.num_cached_tokens} of {len(newcomer)} prompt tokens from the cache")
# A later user finds the whole shared prefix in the cache.
assert later.num_cached_tokens == n_full * BS

# %% [markdown]
# ## Measured on a workload: caching on versus off
#
# Few-shot prompting: three example stories (their token count is printed below) in front of every request, then the
# request's own first line. 24 requests after one warm-up user, 8 output tokens each, greedy. Two
# engines, identical except for `enable_prefix_caching`; we count the prefill tokens each computed and
# time the batch and each request's time to first token.

# %%
examples = ("Story: Tom had a little red ball. He threw it high in the sky and his dog ran after it. They "
            "played all day in the park and went home happy.\n"
            "Story: Lily saw a bird with a hurt wing. She gave it water and seeds. After three days the bird "
            "could fly again and it sang a song for Lily.\n"
            "Story: Ben and Mia built a big sand castle at the beach. A wave came and washed it away, so "
            "they laughed and built an even bigger one.\n")
starts = ["Sam", "Anna", "A little fox", "The old owl", "Max", "Lucy", "A tiny mouse", "Grandpa",
          "The brown bear", "Emma", "A small boat", "Leo", "The baker", "Sara", "A green frog", "Jack",
          "The wind", "Nina", "A kind dragon", "Oscar", "The moon", "Ella", "A busy bee", "Tim", "The snowman"]
few_shot = [examples + "Story: " + s for s in starts]
print(f"{len(few_shot) - 1} requests, prompts of {len(tok.encode(few_shot[1]))} tokens, "
      f"{len(tok.encode(examples))} of them the shared examples")


def workload(caching):
    # float32: a cache hit splits the prompt's work differently, and in bf16 (the CPU default where it is
    # native) a different split rounds differently, so outputs may drift; in float32 they are the same
    engine_llm = LLM(enable_prefix_caching=caching, trace_steps=0, dtype="float32")
    engine_llm.generate(few_shot[:1], greedy(8), use_tqdm=False)  # warm-up user (and warm-up of torch)
    before = engine_llm.engine.stats()["num_prefill_tokens_computed"]
    t0 = time.perf_counter()
    outs = engine_llm.generate(few_shot[1:], greedy(8), use_tqdm=False)
    seconds = time.perf_counter() - t0
    st = engine_llm.engine.stats()
    return {"prefill": st["num_prefill_tokens_computed"] - before, "seconds": seconds,
            "ttft": statistics.mean(o.metrics.time_to_first_token for o in outs),
            "hit_rate": st["prefix_cache_hit_rate"], "tokens": [o.outputs[0].token_ids for o in outs]}


off = workload(False)
on = workload(True)
for name, r in (("caching off", off), ("caching on ", on)):
    print(f"{name}: prefill tokens computed {r['prefill']:5d}, batch {r['seconds'] * 1e3:6.0f} ms, "
          f"mean time to first token {r['ttft'] * 1e3:6.0f} ms, hit rate {r['hit_rate']:.1%}")
saved = 1 - on["prefill"] / off["prefill"]
print(f"prefill tokens saved: {saved:.1%}; batch time saved: {1 - on['seconds'] / off['seconds']:.1%}; "
      f"time to first token {off['ttft'] / on['ttft']:.1f}x shorter")

# %%
assert on["tokens"] == off["tokens"], "prefix caching changes the work done, never the output"
assert saved > 0.8 and off["hit_rate"] == 0 and on["hit_rate"] > 0.8

# %%
fig = Figure(figsize=(8, 2.6))
ax1, ax2 = fig.subplots(1, 2)
ax1.bar(["off", "on"], [off["prefill"], on["prefill"]], color=["#c44e52", "#4c72b0"])
ax1.set_title("prefill tokens computed", fontsize=9)
ax2.bar(["off", "on"], [off["ttft"] * 1e3, on["ttft"] * 1e3], color=["#c44e52", "#4c72b0"])
ax2.set_title("mean time to first token (ms)", fontsize=9)
fig.suptitle(f"{len(few_shot) - 1} few-shot requests, prefix caching off vs on", fontsize=10)
fig.tight_layout()
widgets.show(fig)

# %% [markdown]
# The saving in prefill *tokens* is exact; the saving in *time* is smaller, because a request still
# computes its own suffix, attends over the whole cached context, and decodes its outputs. On a GPU a
# long shared prompt is the expensive part of prefill, so the time to first token drops the most.
#
# ## A fully cached prompt still computes one block
#
# The model's output for the next token comes from the forward pass of the prompt's *last* token. So
# even when every block of a prompt is cached, the last token must be computed, and since the cache works
# in whole blocks, the block that holds it is recomputed. `find_cached_prefix` looks at `(len - 1) // 16`
# blocks at most. A prompt of exactly 48 tokens (3 full blocks) therefore reuses 2 blocks and computes 16
# tokens; one token longer, it reuses all 3 and computes only its last token.

# %%
ids = tok.encode(examples)
for n in (3 * BS, 3 * BS + 1):
    prompt = {"prompt_token_ids": ids[:n]}
    first_out = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
    before = engine.stats()["num_prefill_tokens_computed"]
    again = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
    computed_again = engine.stats()["num_prefill_tokens_computed"] - before
    print(f"{n}-token prompt, second time: {again.num_cached_tokens} tokens from the cache, "
          f"{computed_again} computed")
    assert again.num_cached_tokens == (n - 1) // BS * BS and computed_again == n - again.num_cached_tokens
    assert again.outputs[0].token_ids == first_out.outputs[0].token_ids

# %% [markdown]
# ## Arriving together at a cold cache
#
# A block's hash is registered as soon as the step that will fill it is *scheduled*
# (`KVCacheManager._register_full_blocks`, called from `allocate`), not after it ran. So users who arrive
# together at a cold cache still share: the first one scheduled computes the prefix, and the ones scheduled
# after it in the same step point their block tables at those blocks. That is safe because every layer
# stores the K/V of the whole batch before any attention reads it, so their queries see what the first
# user writes in the very same forward pass (vLLM does the same). Here the cache is emptied
# (`reset_prefix_cache`, allowed when no request holds a block) and the four users arrive at once:

# %%
assert not kv.block_tables
kv.pool.reset_prefix_cache()
for rid, ids in users.items():
    engine.add_request(rid + "-cold", ids, greedy(2))
engine.step()
cold = engine.trace[-1]
print("scheduled together:", [e.request_id for e in cold.scheduled])
print("re-used from the cache in that same step:", cold.cache_hits)
first, *later = [rid + "-cold" for rid in users]
# Arriving together, the first user computes the prefix and the others share its blocks from the first step.
assert first not in cold.cache_hits and all(cold.cache_hits.get(rid) for rid in later)
assert cold.shared_blocks, "the prefix blocks are shared from the first step"
while engine.has_unfinished_requests():
    engine.step()

# %% [markdown]
# ## Eviction under memory pressure: least recently used, tail first
#
# A finished request's blocks join the free queue in an order chosen with care
# (`KVCacheManager.free` and `BlockPool.free`):
#
# * blocks that hold no hashed prefix (a partly filled last block) go to the **front**: nothing is lost
#   when they are reused first;
# * hashed blocks go to the **back**, and a request frees its blocks **tail first**, so its last block
#   sits ahead of its first one: allocation takes from the front, so the head of a prompt, the part most
#   likely to be shared, survives longest.

# %%
print(inspect.getsource(KVCacheManager.free))
print(inspect.getsource(BlockPool.free))
print(inspect.getsource(BlockPool.allocate))

# %% [markdown]
# A pool of 16 blocks. An "old" 80-token prompt (5 full blocks) runs first; then other prompts need
# blocks, and take them from the front of the free queue.

# %%
small = LLM(num_kv_blocks=16)
spool = small.engine.kv.pool
old_ids = tok.encode(examples * 2)[:5 * BS]
old_hashes = chain(old_ids)
small.generate({"prompt_token_ids": old_ids}, greedy(4), use_tqdm=False)


def queue_picture():
    """The free queue, front (next out) first; cached blocks of the old prompt marked with their index."""
    where = {spool.lookup(h): i for i, h in enumerate(old_hashes) if spool.lookup(h) is not None}
    return " ".join(f"[{b}:old {where[b]}]" if b in where else
                    (f"{b}*" if spool.blocks[b].block_hash is not None else str(b)) for b in spool.free_queue)


print("free queue after the old prompt, front (next out) first; [b:old i] = block b holds the old prompt's "
      "block i, b* = block b holds another prompt's cached block:")
print(" ", queue_picture())
order = [b for b in spool.free_queue if b in {spool.lookup(h) for h in old_hashes}]
# A finished request frees its blocks tail first, so its last block is evicted first.
assert order == [spool.lookup(h) for h in reversed(old_hashes)], "its tail is ahead of its head in the queue"

# %%
survivors = []
for k, name in enumerate(starts):  # prompts of 40 tokens (3 blocks with their outputs), each its own
    small.generate({"prompt_token_ids": tok.encode(f"{name} said hello. " + examples)[:40]}, greedy(4),
                   use_tqdm=False)
    alive = [i for i, h in enumerate(old_hashes) if spool.lookup(h) is not None]
    survivors.append(alive)
    print(f"after pressure request {k + 1}: old prompt's blocks still cached {alive}")
    print("   free queue:", queue_picture())
    if 0 < len(alive) < len(old_hashes):
        break
# Eviction eats a cached prompt from its tail, so what survives is always a prefix of it.
assert all(alive == list(range(len(alive))) for alive in survivors), "evicted from the tail: the head survives"
assert 0 < len(survivors[-1]) < len(old_hashes)

# %%
again = small.generate({"prompt_token_ids": old_ids}, greedy(4), use_tqdm=False)[0]
print(f"the old prompt again: {again.num_cached_tokens} of {len(old_ids)} tokens from the cache "
      f"(its first {len(survivors[-1])} blocks)")
# The surviving head of the old prompt is found again, and all blocks are free afterwards.
assert again.num_cached_tokens == len(survivors[-1]) * BS
assert spool.num_free_blocks == spool.num_blocks

# %% [markdown]
# The old prompt lost its tail and kept its head, which is what a later request sharing only the start
# of it can use. A system prompt shared by running requests is never evicted at all: while any request
# holds its blocks, their reference count keeps them out of the free queue; once free, they are the last
# of their prompt to be reused.

# %% [markdown]
# ## Exercise: the chained block name
#
# Write `my_hash_block(parent_hash, token_ids)`: the name of one full block, as `bytes`, computed from its
# parent's name (`None` for a prompt's first block) and its token ids. Two blocks must get the same name
# exactly when they hold the same tokens *after the same prefix*. `hashlib.sha256` gives bytes; mind how
# the ids become bytes (as text, `[1, 23]` and `[12, 3]` can read the same).
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker plugs your code into the real engine through its documented hook,
# `LLM(hooks=EngineHooks(hash_block=...))` (`minivllm.hooks`; nothing is patched), and runs the engine's own
# correctness checks against it; it says *passed*, *not attempted*, or what failed, in plain words. The
# reference solution is `chapters/solutions/ch06_hash_block.py`: try first.
#
# The checker tries the properties a chained name needs, then runs the engine with prefix caching on prompts
# built to trip a name that forgets its parent (one prompt is another shifted by one block), checking that
# shared prefixes are found and that the greedy tokens still equal transformers'.

# %%
import hashlib  # noqa: F401 (you will need it)


def my_hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    raise NotImplementedError  # your code here


# %%
from minivllm.exercises.ch06 import check_hash_block

check_hash_block(my_hash_block)


# %% [markdown]
# ## The engine's version
#
# Once your name passes (or you have given up), compare it with the engine's `hash_block`:

# %%
print(inspect.getsource(hash_block))

# %% [markdown]
# Next: [07 · Speculative decoding: draft cheaply, verify in one pass](07_speculative_decoding.ipynb).
