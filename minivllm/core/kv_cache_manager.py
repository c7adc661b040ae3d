"""KVCacheManager: each request's block table (logical -> physical block), prefix caching, forks.

Blocks are allocated on demand as a sequence grows and returned when it finishes, is aborted or is
preempted. With prefix caching, every *full* block is named by a hash chained to its parent's
(block_hash.py), so the same tokens after the same prefix always get the same name, and a new
request can reuse those blocks.

A fork (beam search) shares *every* block of its parent, the partly filled last one included, by
reference count. Nothing is copied until a sequence writes into a block it shares: `allocate` then
gives it its own copy first (copy-on-write) and records the (src, dst) pair, which the runner copies
before the forward pass.

With sliding windows (kv_groups.py), each group of layers has its own table, interleaved in one list
per request (logical block j of group g at `j * num_groups + g`). A sliding group's block, all of
whose positions are behind the window of the step's first new query, is read by no layer of it
again: `allocate` returns it to the pool (still named, so prefix caching may serve it) and keeps its
id in the table, where masked reads never look at it, so table positions and the runner's copy stay
as they were. With one group (every layer alike) the list is the plain table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from minivllm.core.block_hash import extend_block_hashes, hash_block
from minivllm.core.block_pool import BlockPool
from minivllm.core.math_utils import cdiv
from minivllm.core.sequence import Sequence
from minivllm.hooks import EngineHooks

if TYPE_CHECKING:  # the manager only reads its numbers
    from minivllm.core.kv_groups import KVCacheGroups


class KVEvent(NamedTuple):
    """One thing that happened to a block in a step, for the trace the widgets draw."""

    kind: str  # "alloc", "hit" (prefix cache), "free", "fork", "cow", "swap_out", "swap_in"
    request_id: str  # the sequence's id
    block_id: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hooks: EngineHooks | None = None, groups: KVCacheGroups | None = None) -> None:
        """`hooks`: a learner's own BlockPool class or hash_block (minivllm.hooks); None: ours.
        `groups`: the layers' KV-cache groups (None: one group of full-attention layers)."""
        hooks = hooks or EngineHooks()
        self.block_size = block_size
        self.pool = (hooks.block_pool_cls or BlockPool)(num_blocks)
        self.hash_block = hooks.hash_block or hash_block
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # how many of a request's blocks the pool names
        self.groups = groups
        self.num_groups = groups.num_groups if groups else 1
        self.sliding_groups = groups.sliding if groups else ()
        self.window = next((w for w in groups.windows if w is not None), None) if groups else None
        # leading logical blocks whose sliding groups' blocks went back as the window passed them
        self.num_dropped: dict[str, int] = {}
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
        """Blocks (of every group) that hold `num_tokens` tokens, before any window passes them."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def num_logical_blocks(self, blocks) -> int:
        """How many blocks of tokens a (table or cached) list of every group's blocks spans."""
        return len(blocks) // self.num_groups

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """The name of a group's block: the same tokens in two groups are two different blocks."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

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
            found = [self.pool.lookup(self._key(block_hash, g)) for g in range(self.num_groups)]
            if None in found:  # every group must have the block
                break
            hits += found
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached_blocks: list[int] | tuple[int, ...] = ()) -> bool:
        """Room for `num_new_tokens` more tokens (after any `cached_blocks`), or False. All or
        nothing: if the pool is short, nothing changes; the scheduler picks whom to preempt."""
        rid, groups = seq.request_id, self.num_groups
        table = self.block_tables.get(rid, [])
        num_tokens = (seq.num_computed_tokens + self.num_logical_blocks(cached_blocks)
                      * self.block_size + num_new_tokens)
        num_new_blocks = max(self.blocks_needed(num_tokens) - len(table) - len(cached_blocks), 0)
        idle_hits = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        write_at = seq.num_computed_tokens // self.block_size * groups  # first new token's blocks
        shared = [] if cached_blocks else [  # shared, partly filled: each group writes its own copy
            i for i in range(write_at, min(write_at + groups, len(table)))
            if self.pool.blocks[table[i]].ref_cnt > 1]
        if num_new_blocks + idle_hits + len(shared) > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(rid, [])
        self._drop_passed_blocks(seq)
        for i in shared:  # copy-on-write: leave the others their block
            src, table[i] = table[i], self.pool.allocate()
            self.pool.free(src)
            self.copies.append((src, table[i]))
            self.events.append(KVEvent("cow", rid, table[i]))
            self.num_cow_copies += 1
        for block_id in cached_blocks:
            self.pool.touch(block_id)
            table.append(block_id)
            self.events.append(KVEvent("hit", rid, block_id))
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
            self.events.append(KVEvent("alloc", rid, table[-1]))
        if cached_blocks:
            self.num_registered[rid] = self.num_logical_blocks(cached_blocks)
        self._register_full_blocks(seq, min(num_tokens, seq.num_tokens))  # drafts are not final
        return True

    def _drop_passed_blocks(self, seq: Sequence) -> None:
        """Return the sliding groups' blocks the window has passed: the first new query, at position
        p = num_computed_tokens, sees keys after p - window, so blocks ending at or before that
        position are never read again (nor by later queries: their windows start later)."""
        if self.window is None:
            return
        rid, table = seq.request_id, self.block_tables[seq.request_id]
        passed = max(seq.num_computed_tokens - self.window + 1, 0) // self.block_size
        passed = min(passed, self.num_registered.get(rid, passed) if self.enable_prefix_caching
                     else passed, self.num_logical_blocks(table))
        for j in range(self.num_dropped.get(rid, 0), passed):
            for g in self.sliding_groups:
                self.pool.free(table[j * self.num_groups + g])
                self.events.append(KVEvent("free", rid, table[j * self.num_groups + g]))
        self.num_dropped[rid] = max(self.num_dropped.get(rid, 0), passed)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks a request holds now: its tables less the blocks the window has passed."""
        return [b for b in self.table_with_gaps(request_id) if b >= 0]

    def table_with_gaps(self, request_id: str) -> list[int]:
        """A request's table as it stands, -1 where the window passed a block and it went back."""
        table, dropped = self.block_tables.get(request_id, []), self.num_dropped.get(request_id, 0)
        if not dropped:
            return list(table)
        passed = {j * self.num_groups + g for j in range(dropped) for g in self.sliding_groups}
        return [-1 if i in passed else b for i, b in enumerate(table)]

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
        for j in range(start, end):
            for g in range(self.num_groups):
                self.pool.cache(table[j * self.num_groups + g], self._key(hashes[j], g))
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
