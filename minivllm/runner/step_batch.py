"""One step's batch: a `StepRow` per scheduled sequence (what to compute, where its logits land,
what came out: every phase of `ModelRunner.execute` reads and writes these), and the flat host
arrays the model reads, with no padding: per token its id, position and cache slot; per sequence its
block table and context length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.attention import AttentionMetadata
from minivllm.core.kv_groups import KVCacheGroups
from minivllm.runner.sequence_state import SequenceState


@dataclass(slots=True, eq=False)
class StepRow:
    """One sequence's share of a forward pass, and its results."""

    token_ids: list[int]  # the sequence's known tokens (drafts excluded)
    block_table: list[int]
    num_computed: int  # tokens already in the cache
    num_new: int  # tokens to compute now, drafts included
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = True  # the scheduler's word: this pass reaches the end of the known tokens
    all_logits: bool = False  # logits for every new token, not only sampled ones (prompt logprobs)
    state: SequenceState | None = None  # the runner's memory of it (None: a drafter's own rows)
    logit_rows: range = range(0)  # its rows of the step's logits (set by prepare_inputs)
    raw_logprobs: torch.Tensor | None = None  # its sample rows' log-softmax, unprocessed, if asked
    sampled: list[int] = field(default_factory=list)  # accepted drafts + 1 new token

    @property
    def num_logit_rows(self) -> int:
        if self.all_logits:
            return self.num_new
        return 1 + len(self.spec_token_ids) if self.samples else 0

    @property
    def sample_rows(self) -> range:
        """The rows it samples from: its last one, or the last 1 + k when it verifies k drafts."""
        if not self.samples:
            return range(0)
        return range(self.logit_rows.stop - 1 - len(self.spec_token_ids), self.logit_rows.stop)


@dataclass
class StepInputs:
    """One step's flat batch as host arrays, to copy to the device (or into a graph's buffers)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [groups, T] int64: block_id * block_size + offset, per group
    block_tables: np.ndarray  # [B, widest table] int32, zero-padded; groups interleaved
    query_lens: list[int]  # [B] new tokens per sequence
    seq_lens: list[int]  # [B] context length after this step
    logit_rows: list[int]  # the rows of the batch whose logits are needed


def prepare_inputs(rows: Sequence[StepRow], block_size: int, num_groups: int = 1) -> StepInputs:
    """Flatten the step on the host: each token's id, position and cache slot (one per group of
    layers: a table holds every group's blocks, logical block j of group g at j * num_groups + g);
    each table."""
    n = sum(r.num_new for r in rows)
    input_ids, positions = np.empty(n, np.int64), np.empty(n, np.int64)
    slots = np.empty((num_groups, n), np.int64)
    tables = np.zeros((len(rows), max(len(r.block_table) for r in rows)), dtype=np.int32)
    groups = np.arange(num_groups)[:, None]
    query_lens, seq_lens, logit_rows = [], [], []
    t = 0  # where this sequence's tokens start in the flat batch
    for i, r in enumerate(rows):
        start, q, table = r.num_computed, r.num_new, r.block_table
        tables[i, : len(table)] = table
        if q == 1:  # a decode (most of them): plain integers are faster than building arrays
            input_ids[t], positions[t] = r.token_ids[start], start
            first, offset = start // block_size * num_groups, start % block_size
            for g in range(num_groups):
                slots[g, t] = table[first + g] * block_size + offset
        else:
            pos = np.arange(start, start + q)
            known = r.token_ids[start : start + q - len(r.spec_token_ids)]
            input_ids[t : t + q] = known + r.spec_token_ids
            positions[t : t + q] = pos
            blocks = tables[i, pos // block_size * num_groups + groups].astype(np.int64)
            slots[:, t : t + q] = blocks * block_size + pos % block_size
        t += q
        query_lens.append(q)
        seq_lens.append(start + q)
        first = len(logit_rows)
        logit_rows += range(t - r.num_logit_rows, t)
        r.logit_rows = range(first, len(logit_rows))
    return StepInputs(input_ids, positions, slots, tables, query_lens, seq_lens, logit_rows)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":  # pinned host memory lets the copy run without stalling the host
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def attention_metadata(inputs: StepInputs, device: torch.device,
                       groups: KVCacheGroups | None = None) -> AttentionMetadata:
    """What every attention layer needs to know about the flat batch (attention/metadata.py); with
    several groups of layers, each group's view, through its own tables and slots."""
    starts = np.zeros(len(inputs.query_lens) + 1, dtype=np.int32)
    np.cumsum(inputs.query_lens, out=starts[1:])
    seq_lens, starts = (to_device(np.array(inputs.seq_lens, dtype=np.int32), device),
                        to_device(starts, device))
    num_groups = inputs.slot_mapping.shape[0]
    views = [AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping[g], device),
        block_tables=to_device(inputs.block_tables if num_groups == 1 else
                               inputs.block_tables[:, g::num_groups].copy(), device),
        seq_lens=seq_lens, query_start_loc=starts,
        max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens),
        query_lens_cpu=inputs.query_lens, seq_lens_cpu=inputs.seq_lens) for g in range(num_groups)]
    if num_groups > 1:
        views[0].group_views = views
        views[0].layer_places = groups.places
    return views[0]
