"""PersistentBatch: stable rows for the requests that sample, so logits processors can keep state.

vLLM's processors index their state by batch row and are told how rows change (`BatchUpdate`); the
runner knows requests by id, and the set that samples changes every step. As vLLM's persistent input
batch does, a request keeps its row while it samples, frees it when it stops, an arrival takes the
lowest free row, and the rows are packed (UNIDIRECTIONAL moves) so they stay 0..batch_size-1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from minivllm.sampling.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessor,
    MoveDirectionality,
    load_logits_processor_classes,
)
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.config import EngineConfig


class _Entry:
    """What a processor may see of a request: its params, prompt, and a live list of its outputs."""

    __slots__ = ("params", "prompt_token_ids", "token_ids", "output_token_ids")

    def __init__(self, params: SamplingParams, token_ids: list[int],
                 num_prompt_tokens: int) -> None:
        self.params = params
        self.prompt_token_ids = list(token_ids[:num_prompt_tokens])
        self.token_ids = token_ids  # the runner's list (prompt + output), extended as it samples
        self.output_token_ids = list(token_ids[num_prompt_tokens:])

    def sync(self) -> None:
        """Bring the output list up to date in place: processors hold a reference to this list."""
        done = len(self.prompt_token_ids) + len(self.output_token_ids)
        if len(self.token_ids) > done:
            self.output_token_ids.extend(self.token_ids[done:])


class PersistentBatch:
    def __init__(self, config: EngineConfig, device: torch.device,
                 processors: Sequence[type[LogitsProcessor] | str] | None = None) -> None:
        """Build one instance of each processor class (`config.logits_processors` unless given)."""
        classes = load_logits_processor_classes(processors if processors is not None
                                                else config.logits_processors)
        pin = device.type == "cuda"
        self.processors: list[LogitsProcessor] = [cls(config, device, pin) for cls in classes]
        self.entries: dict[str, _Entry] = {}  # every request the runner holds
        self.rows: dict[str, int] = {}  # request id -> row, for the requests in the batch now
        self._builder = BatchUpdateBuilder()

    def add_request(self, request_id: str, params: SamplingParams, token_ids: list[int],
                    num_prompt_tokens: int) -> None:
        """A request reached the runner (new, or after a preemption); `token_ids`: its live list."""
        if self.processors:
            self.entries[request_id] = _Entry(params, token_ids, num_prompt_tokens)

    def remove_request(self, request_id: str) -> None:
        """A request left the runner (finished, preempted): next apply() reports its row removed."""
        self.entries.pop(request_id, None)
        if request_id in self.rows:
            self._builder.removed_append(self.rows.pop(request_id))

    def apply(self, request_ids: Sequence[str], logits: torch.Tensor) -> torch.Tensor:
        """Run every processor over these requests' logits (row i of `logits` = request_ids[i]);
        returns float32 logits in the same order. Unchanged when no processor is configured."""
        if not self.processors or not request_ids:
            return logits
        batch_update = self._update_rows(request_ids)
        for rid in request_ids:
            self.entries[rid].sync()
        greedy = all(self.entries[rid].params.greedy for rid in request_ids)
        for proc in self.processors:
            proc.update_state(batch_update)
        order = [0] * len(request_ids)  # order[row] = where that row's request sits in `logits`
        for i, rid in enumerate(request_ids):
            order[self.rows[rid]] = i
        identity = order == list(range(len(order)))
        # a copy either way: the caller's tensor may be the model's logits, which logprobs read
        rows = logits.float().clone() if identity else logits.float()[order]
        for proc in sorted(self.processors, key=lambda p: p.is_argmax_invariant()):  # vLLM's order
            if not (greedy and proc.is_argmax_invariant()):
                rows = proc.apply(rows)
        return rows if identity else rows[[self.rows[rid] for rid in request_ids]]

    def _update_rows(self, request_ids: Sequence[str]):
        """Free the rows of requests not sampling now, give arrivals the lowest free rows, pack."""
        b, now = self._builder, set(request_ids)
        next_row = len(self.rows) + len(b._removed)  # rows were 0..n-1 after the last step (packed)
        for rid in [r for r in self.rows if r not in now]:
            b.removed_append(self.rows.pop(rid))
        for rid in request_ids:
            if rid in self.rows:
                continue
            row = b.pop_removed()  # the lowest free row; it is then no longer reported as removed
            if row is None:
                row, next_row = next_row, next_row + 1
            self.rows[rid] = row
            entry = self.entries[rid]
            b.added.append((row, entry.params, entry.prompt_token_ids, entry.output_token_ids))
        self._pack(len(request_ids))
        return b.get_and_reset(len(request_ids))

    def _pack(self, batch_size: int) -> None:
        """Move the highest-numbered requests into the holes below batch_size."""
        by_row = {row: rid for rid, row in self.rows.items()}
        holes = sorted(set(range(batch_size)) - set(by_row))
        for hole in holes:
            top = max(by_row)
            if top < hole:
                break
            rid = by_row.pop(top)
            by_row[hole] = rid
            self.rows[rid] = hole
            self._builder.moved.append((top, hole, MoveDirectionality.UNIDIRECTIONAL))

