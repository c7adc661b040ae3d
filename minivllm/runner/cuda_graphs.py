"""CUDA graphs for decode steps: launch a whole forward pass with one call instead of hundreds.

A decode step of a small model is launch bound: each layer is a dozen kernels that finish in
microseconds, and the host spends longer issuing them than the GPU spends running them. A CUDA graph
records the launches once and replays them as one unit. The price is that a replay repeats the
recording exactly:

* the same tensors: inputs are copied into the static buffers the graph was recorded with, and the
  output is read from the buffer it wrote;
* the same shapes: one graph per batch size in `capture_sizes`; a batch is padded up to the next
  size, padding rows writing nothing to the cache (slot -1) and reading one token; above the
  largest size (and for prefill or mixed steps, whose shapes vary) the model runs eagerly;
* the same launch parameters: the decode kernel's split-K count cannot follow the context length, so
  it is fixed per size (`num_splits`).

`capture=False` runs the very same padded static-buffer batches without recording a graph: that is
how CPU tests check everything here but the recording itself, which only CUDA can do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.attention import AttentionMetadata
from minivllm.config import EngineConfig
from minivllm.core.kv_groups import KVCacheGroups, kv_cache_groups
from minivllm.core.math_utils import cdiv


def capture_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16: padding wastes at most 15 rows of a large batch."""
    top = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    return sizes if sizes[-1] == top else sizes + [top]


def build_decode_graphs(model, kv_cache: torch.Tensor, config: EngineConfig,
                        device: torch.device) -> DecodeGraphs:
    """Recorded decode steps, where the platform captures them (platforms/cuda.py: GPU, not eager).
    A graph replays the launches it recorded, so the decode kernel's split-K count is fixed per
    size: chosen for the longest context (slices of shorter contexts just end early; an empty slice
    is cheap)."""
    from minivllm.kernels.paged_decode import choose_num_splits, num_sms  # Triton: imported here

    sms, kv_heads = num_sms(device), config.model_config.num_kv_heads
    graphs = DecodeGraphs(model, kv_cache, capture_sizes(config.max_num_seqs),
                          cdiv(config.max_model_len, config.block_size), device,
                          lambda size: choose_num_splits(size, kv_heads, config.max_model_len, sms),
                          groups=config.kv_groups)
    graphs.capture()
    return graphs


class DecodeGraphs:
    """A recorded decode step per batch size for a model and KV cache, and the buffers they read."""

    def __init__(self, model, kv_cache: torch.Tensor, sizes: list[int], max_blocks_per_seq: int,
                 device: torch.device, num_splits: Callable[[int], int],
                 capture: bool = True, groups: KVCacheGroups | None = None) -> None:
        """`groups`: a hybrid model's groups of layers, each with its own tables and slots."""
        self.model, self.kv_cache, self.sizes = model, kv_cache, sorted(sizes)
        self.groups = groups or kv_cache_groups(1, None)
        num_groups = self.groups.num_groups
        self.use_graphs, self.num_splits = capture, num_splits
        largest = self.sizes[-1]
        # the static buffers: every replay reads its inputs from here
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        # slots and tables per group of layers; `slot_mapping` and `block_tables` are the first's
        self.group_slots = torch.full((num_groups, largest), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.group_tables = torch.zeros(num_groups, largest, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.slot_mapping, self.block_tables = self.group_slots[0], self.group_tables[0]
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, for every replay
        self.last_replay: tuple[int, int] | None = None  # (requests, graph size) of the latest step
        self.num_replays = 0  # decode steps served so far

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the static buffers; its host-side fields are fixed at record time."""
        longest = self.block_tables.shape[1] * self.kv_cache.shape[3]
        views = [AttentionMetadata(self.group_slots[g, :size], self.group_tables[g, :size],
                                   self.seq_lens[:size], self.query_start_loc[: size + 1],
                                   max_query_len=1, max_seq_len=longest,
                                   query_lens_cpu=[1] * size, seq_lens_cpu=[longest] * size,
                                   num_splits=self.num_splits(size))
                 for g in range(self.groups.num_groups)]
        if len(views) > 1:
            views[0].group_views, views[0].layer_places = views, self.groups.places
        return views[0]

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache,
                          self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record a graph per size, largest first, sharing one memory pool (one runs at a time)."""
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the Triton kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, inputs) -> bool:
        """A pure decode batch (one token each, no drafts) that fits the largest graph."""
        return len(inputs.query_lens) <= self.sizes[-1] and max(inputs.query_lens) == 1

    def run(self, inputs) -> torch.Tensor:
        """Copy the inputs into the static buffers, pad to the next size, replay: [B, hidden]."""
        n = len(inputs.query_lens)
        size = next(s for s in self.sizes if s >= n)
        num_groups = self.groups.num_groups
        # a table holds every group's blocks, interleaved: one table per group in the buffers
        tables = torch.from_numpy(inputs.block_tables).unflatten(1, (-1, num_groups))
        self.input_ids[:n].copy_(torch.from_numpy(inputs.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        self.group_slots[:, :n].copy_(torch.from_numpy(inputs.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(inputs.seq_lens, dtype=torch.int32), non_blocking=True)
        self.group_tables[:, :n, : tables.shape[1]].copy_(tables.permute(2, 0, 1),
                                                          non_blocking=True)
        self.group_slots[:, n:size].fill_(-1)  # padding rows: store nothing ...
        self.seq_lens[n:size].fill_(1)  # ... and attend to a single (harmless) position
        self.last_replay = (n, size)
        self.num_replays += 1
        if not self.use_graphs:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
