"""KVCacheManager: each request's block table (logical -> physical block), prefix caching, forks.

Blocks are allocated on demand as a sequence grows and returned when it finishes, is aborted or is
preempted. With prefix caching, every *full* block is named by a hash chained to its parent's
(block_hash.py), so the same tokens after the same prefix always get the same name, and a new
request can reuse those blocks.

A fork (beam search) shares *every* block of its parent, the partly filled last one included, by
reference count. Nothing is copied until a sequence writes into a block it shares: `allocate` then
gives it its own copy first (copy-on-write) and records the (src, dst) pair, which the runner copies
before the forward pass.

With a sliding window that every layer uses (Mistral v0.1), a block all of whose positions are
behind the window of the step's first new query is read by no layer again: `allocate` returns it
to the pool (still named, so prefix caching may serve it) and keeps its id in the table, where
masked reads never look at it, so table positions and the runner's copy stay as they were.
"""

from __future__ import annotations

from typing import NamedTuple

from minivllm.core.block_hash import extend_block_hashes, hash_block
from minivllm.core.block_pool import BlockPool
from minivllm.core.math_utils import cdiv
from minivllm.core.sequence import Sequence
from minivllm.hooks import EngineHooks


class KVEvent(NamedTuple):
    """One thing that happened to a block in a step, for the trace the widgets draw."""

    kind: str  # "alloc", "hit" (prefix cache), "free", "fork", "cow", "swap_out", "swap_in"
    request_id: str  # the sequence's id
    block_id: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hooks: EngineHooks | None = None, sliding_window: int | None = None) -> None:
        """`hooks`: a learner's own BlockPool class or hash_block (minivllm.hooks); None: ours.
        `sliding_window`: the window of every layer, when all slide (None: blocks are held to the
        end)."""
        hooks = hooks or EngineHooks()
        self.block_size = block_size
        self.pool = (hooks.block_pool_cls or BlockPool)(num_blocks)
        self.hash_block = hooks.hash_block or hash_block
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # how many of a request's blocks the pool names
        self.sliding_window = sliding_window
        self.num_dropped: dict[str, int] = {}  # leading blocks returned as the window passed them
        self.events: list[KVEvent] = []  # since the last step, drained into its record
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), not yet sent
        self.num_forked_blocks = 0  # blocks forks shared instead of copying
        self.num_cow_copies = 0  # blocks copied because a sequence wrote into a shared one

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding a prefix of this (new or preempted) request's tokens. The last
        token is never served from the cache: its forward pass is what yields the logits for the
        next token, so a fully cached prompt still computes one token."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            # prompt logprobs need every prompt position's logits: nothing may be skipped (as vLLM)
            return []
        tokens = seq.all_token_ids
        hashes = extend_block_hashes(seq.block_hashes, tokens, self.block_size, self.hash_block)
        hits = []
        for block_hash in hashes[: (len(tokens) - 1) // self.block_size]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached_blocks: list[int] | tuple[int, ...] = ()) -> bool:
        """Room for `num_new_tokens` more tokens (after any `cached_blocks`), or False. All or
        nothing: if the pool is short, nothing changes; the scheduler picks whom to preempt."""
        rid = seq.request_id
        table = self.block_tables.get(rid, [])
        num_tokens = seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(self.blocks_needed(num_tokens) - len(table) - len(cached_blocks), 0)
        idle_hits = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        write_at = seq.num_computed_tokens // self.block_size  # the first new token's block
        cow = (not cached_blocks and write_at < len(table)
               and self.pool.blocks[table[write_at]].ref_cnt > 1)
        if num_new_blocks + idle_hits + cow > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(rid, [])
        self._drop_passed_blocks(seq)
        if cow:  # a shared, partly filled block: write into our own copy, leave the others theirs
            src, table[write_at] = table[write_at], self.pool.allocate()
            self.pool.free(src)
            self.copies.append((src, table[write_at]))
            self.events.append(KVEvent("cow", rid, table[write_at]))
            self.num_cow_copies += 1
        for block_id in cached_blocks:
            self.pool.touch(block_id)
            table.append(block_id)
            self.events.append(KVEvent("hit", rid, block_id))
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
            self.events.append(KVEvent("alloc", rid, table[-1]))
        if cached_blocks:
            self.num_registered[rid] = len(cached_blocks)
        self._register_full_blocks(seq, min(num_tokens, seq.num_tokens))  # drafts are not final
        return True

    def _drop_passed_blocks(self, seq: Sequence) -> None:
        """Return the blocks every layer's window has passed: the first new query, at position
        p = num_computed_tokens, sees keys after p - window, so blocks ending at or before that
        position are never read again (nor by later queries: their windows start later)."""
        if self.sliding_window is None:
            return
        rid, table = seq.request_id, self.block_tables[seq.request_id]
        passed = max(seq.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        passed = min(passed, self.num_registered.get(rid, passed) if self.enable_prefix_caching
                     else passed, len(table))
        for i in range(self.num_dropped.get(rid, 0), passed):
            self.pool.free(table[i])
            self.events.append(KVEvent("free", rid, table[i]))
        self.num_dropped[rid] = max(self.num_dropped.get(rid, 0), passed)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks a request holds now: its table less those the window has passed."""
        return self.block_tables.get(request_id, [])[self.num_dropped.get(request_id, 0):]

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Give the pool the name of every block this step fills, once scheduled: sequences
        scheduled later in the same step can then share it already (each layer stores the whole
        batch's K/V before any attention reads it, so their queries see what this one writes)."""
        if not self.enable_prefix_caching:
            return
        rid = seq.request_id
        hashes = extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_size,
                                     self.hash_block)
        table, start = self.block_tables[rid], self.num_registered.get(rid, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            self.pool.cache(table[i], hashes[i])
        self.num_registered[rid] = max(start, end)

    def fork(self, parent_id: str, child: Sequence) -> None:
        """Give `child` the parent's whole table by reference: one more reader a block, no copy."""
        table = self.block_tables[parent_id]
        for block_id in self.held_blocks(parent_id):
            self.pool.touch(block_id)
            self.events.append(KVEvent("fork", child.request_id, block_id))
        self.block_tables[child.request_id] = list(table)
        self.num_dropped[child.request_id] = self.num_dropped.get(parent_id, 0)
        self.num_registered[child.request_id] = self.num_registered.get(parent_id, 0)
        self.num_forked_blocks += len(table)

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def swap_out(self, seq: Sequence) -> list[int]:
        """Free a sequence whose computed blocks go to host memory; returns the blocks holding its
        data, in order (a pending copy-on-write's source: the copy has not happened yet)."""
        rid = seq.request_id
        used = self.block_tables.get(rid, [])[: self.blocks_needed(seq.num_computed_tokens)]
        pending = {dst: src for src, dst in self.copies}
        self.events += [KVEvent("swap_out", rid, b) for b in used]
        holding = [pending.get(b, b) for b in used]
        self.free(seq)
        return holding

    def swap_in(self, seq: Sequence, num_host_blocks: int, num_new_tokens: int) -> list[int] | None:
        """Fresh blocks for a swapped sequence's `num_host_blocks`, plus room for `num_new_tokens`
        more; None (nothing changed) when the pool is short."""
        if self.blocks_needed(seq.num_computed_tokens + num_new_tokens) > self.num_free_blocks:
            return None
        rid = seq.request_id
        table = self.block_tables.setdefault(rid, [])
        for _ in range(num_host_blocks):
            table.append(self.pool.allocate())
            self.events.append(KVEvent("swap_in", rid, table[-1]))
        fresh = list(table)
        self.num_registered[rid] = 0
        self.num_dropped[rid] = 0
        self._register_full_blocks(seq, seq.num_computed_tokens)  # the copies hold the same tokens
        if not self.allocate(seq, num_new_tokens):  # cannot fail: room was checked above
            raise RuntimeError(f"swap-in of {rid}: the pool changed while it was being filled")
        return fresh

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        """Return a request's blocks, tail first, so its shared head stays cached longest."""
        rid = seq.request_id
        for block_id in reversed(self.held_blocks(rid)):
            self.pool.free(block_id)
            self.events.append(KVEvent("free", rid, block_id))
        self.block_tables.pop(rid, None)
        self.num_registered.pop(rid, None)
        self.num_dropped.pop(rid, None)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while requests hold blocks, as in
        vLLM. `reset_running_requests=True` resets anyway: blocks in use lose their names too, so no
        new request can share them, while their owners keep reading them (vLLM preempts the owners
        instead; either way the cache is empty for new lookups and the outputs do not change)."""
        if self.pool.num_free_blocks < self.pool.num_blocks and not reset_running_requests:
            return False
        self.pool.reset_prefix_cache()
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
