"""AttentionMetadata: what one step's flattened batch looks like to every attention layer.

The step's tokens from all requests are concatenated into one list of T tokens. Request b owns
tokens query_start_loc[b]:query_start_loc[b+1] (its new tokens), and after the step its context
holds seq_lens[b] tokens, stored in the physical blocks block_tables[b, :]. Token t's K and V go to
slot slot_mapping[t] = block_id * block_size + offset. A query at position p sees keys 0..p.

A hybrid model's layers are cut into groups with tables of their own (core/kv_groups.py): each
group sees the step through its own metadata (`group_views`), which differs only in the tables and
the slot mapping, and `for_layer` says which one a layer reads and which page slot it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding (nothing stored)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_lens)
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: prefix sums of the number of new tokens
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_splits: int | None = None  # decode split-K slices: fixed inside a CUDA graph, else per step
    # the torch backend's grouping of this step's requests (rows, block ids, masks): built by the
    # first layer, reused by the others; keyed by (query length, GQA group size, batch indices)
    group_plans: dict = field(default_factory=dict, repr=False)
    group_views: list[AttentionMetadata] | None = None  # per group of layers (None: one group)
    layer_places: tuple[tuple[int, int], ...] | None = None  # per layer: (group, page slot)

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """(page slot, metadata) of a layer: its slice of the cache, and the tables to read it."""
        if self.layer_places is None:
            return layer, self
        group, slot = self.layer_places[layer]
        return slot, self.group_views[group]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
