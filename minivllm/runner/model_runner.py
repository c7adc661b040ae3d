"""ModelRunner: owns the weights, the KV cache tensor and the sampler; executes one scheduled step.

All requests' new tokens are flattened into one batch with no padding. Per token it builds the position
and the cache slot to write; per request the block table and context length the attention kernels read.
On a GPU, decode batches replay CUDA graphs instead (padded to a captured size: see cuda_graphs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention import AttentionMetadata, get_attention_backend
from minivllm.config import EngineConfig
from minivllm.core.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    gpu_kv_budget,
    kv_bytes_per_block,
    max_useful_blocks,
    num_blocks_for_budget,
)
from minivllm.core.scheduler import ScheduledRequest, SchedulerOutput
from minivllm.model import load_model, read_model_config
from minivllm.sampling import Sampler, SamplingBatch
from minivllm.sampling.rejection_sampler import verify_greedy, verify_sampled
from minivllm.sampling.sampler import processed_probs


@dataclass
class StepInputs:
    """One step's flat batch as host arrays: what gets copied to the device (or into a graph's buffers)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: block_id * block_size + offset
    block_tables: np.ndarray  # [B, widest table] int32, zero-padded
    query_lens: list[int]  # [B] new tokens per request
    seq_lens: list[int]  # [B] context length after this step
    logit_rows: list[int]  # the rows of the batch whose logits are needed
    counts: list[int]  # [B] how many of those rows each request owns


class ModelRunner:
    def __init__(self, config: EngineConfig, reserved_bytes: int = 0, companion_bytes_per_block: int = 0) -> None:
        """reserved_bytes and companion_bytes_per_block: GPU memory a speculative draft model will take after
        this runner sizes its KV cache (its weights, and one of its KV blocks for each of ours)."""
        self.config = config
        self.reserved_bytes, self.companion_bytes_per_block = reserved_bytes, companion_bytes_per_block
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:0: so must we, or
            self.device = torch.device("cuda", torch.cuda.current_device())  # device checks would never match
        self.model_config = read_model_config(config.model)
        self.dtype = config.resolve_dtype(self.model_config.torch_dtype)
        self.backend = get_attention_backend(config.attention_backend, config.device)
        self.model = load_model(config.model, self.model_config, self.backend, self.dtype, config.device)
        self.sampler = Sampler(config.seed)
        mc = self.model_config
        self.bytes_per_block = kv_bytes_per_block(mc.num_layers, config.block_size, mc.num_kv_heads,
                                                  mc.head_dim, self.dtype.itemsize)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        if self.num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower the model size or raise the budget")
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]; zeros so unused slots are never NaN
        self.kv_cache = torch.zeros(mc.num_layers, 2, self.num_blocks, config.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
        self.graphs = None  # DecodeGraphs, once capture_decode_graphs has run

    def _blocks_from_memory(self) -> int:
        """As many blocks as the budget holds, but no more than the sequences could ever fill."""
        cfg = self.config
        max_len = cfg.max_model_len or self.model_config.max_position_embeddings
        return min(self._blocks_in_budget(), max_useful_blocks(cfg.max_num_seqs, max_len, cfg.block_size))

    def _blocks_in_budget(self) -> int:
        cfg = self.config
        if self.device.type != "cuda":
            return num_blocks_for_budget(cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES, self.bytes_per_block)
        if cfg.kv_cache_memory_bytes:
            return num_blocks_for_budget(cfg.kv_cache_memory_bytes, self.bytes_per_block)
        torch.cuda.empty_cache()
        peak_extra = self.profile_run()
        free, total = torch.cuda.mem_get_info()
        budget = gpu_kv_budget(total, cfg.gpu_memory_utilization, total - free + peak_extra)
        # a draft model's cache mirrors ours block for block: size ours for both
        per_block = self.bytes_per_block + self.companion_bytes_per_block
        return num_blocks_for_budget(budget - self.reserved_bytes, per_block)

    def profile_run(self) -> int:
        """One forward pass at the largest step size; returns its activation peak in bytes (0 off CUDA).

        The KV cache gets what is left after weights and this peak, so a full step can never run out.
        """
        n, mc, bs = self.config.max_num_batched_tokens, self.model_config, self.config.block_size
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        cache = torch.zeros(mc.num_layers, 2, -(-n // bs), bs, mc.num_kv_heads, mc.head_dim,
                            dtype=self.dtype, device=self.device)
        table = np.arange(cache.shape[2], dtype=np.int32)[None]  # one request spanning the whole cache
        inputs = StepInputs(np.zeros(n, np.int64), np.arange(n) % mc.max_position_embeddings, np.arange(n), table,
                            [n], [n], list(range(n - min(n, self.config.max_num_seqs), n)), [])
        with torch.inference_mode():
            hidden = self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions), cache,
                                self._metadata(inputs))
            self.model.compute_logits(hidden[inputs.logit_rows])
        del cache, hidden
        return torch.cuda.max_memory_allocated() - base if cuda else 0

    def capture_decode_graphs(self, max_model_len: int) -> None:
        """Record decode steps as CUDA graphs, where they can run (CUDA, Triton backend, not enforce_eager).

        Called once the engine knows max_model_len (how wide a block table can get).
        """
        cfg = self.config
        if self.device.type != "cuda" or self.backend.name != "triton" or cfg.enforce_eager:
            return
        from minivllm.runner.cuda_graphs import DecodeGraphs, capture_sizes

        self.graphs = DecodeGraphs(self.model, self.kv_cache, capture_sizes(cfg.max_num_seqs),
                                   -(-max_model_len // cfg.block_size), self.device,
                                   self._decode_splits(max_model_len))
        self.graphs.capture()

    def _decode_splits(self, max_model_len: int):
        """A graph replays the launches it recorded, so the decode kernel's split-K count is fixed per size.

        Chosen for the longest context: slices of shorter contexts just end early (an empty slice is cheap).
        """
        from minivllm.kernels.paged_decode import choose_num_splits, num_sms

        sms, kv_heads = num_sms(self.device), self.model_config.num_kv_heads
        return lambda size: choose_num_splits(size, kv_heads, max_model_len, sms)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":  # pinned host memory lets the copy run without stalling the host
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        starts = np.zeros(len(inputs.query_lens) + 1, dtype=np.int32)
        np.cumsum(inputs.query_lens, out=starts[1:])
        return AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping),
            block_tables=self._to_device(inputs.block_tables),
            seq_lens=self._to_device(np.array(inputs.seq_lens, dtype=np.int32)),
            query_start_loc=self._to_device(starts),
            max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens),
            query_lens_cpu=inputs.query_lens, seq_lens_cpu=inputs.seq_lens)

    def prepare_inputs(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepInputs:
        """Flatten the step on the host: each token's id, position and cache slot; each request's table."""
        bs, scheduled = self.config.block_size, sched.scheduled
        n = sched.num_tokens
        input_ids, positions, slots = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        tables = np.zeros((len(scheduled), max(len(block_tables[s.request.request_id]) for s in scheduled)),
                          dtype=np.int32)
        query_lens, seq_lens, rows, counts = [], [], [], []
        t = 0  # where this request's tokens start in the flat batch
        for i, s in enumerate(scheduled):
            req, start, q = s.request, s.num_computed_before, s.num_new_tokens
            table = block_tables[req.request_id]
            tables[i, : len(table)] = table
            if q == 1:  # a decode (most of them): plain integers are faster than building arrays
                input_ids[t], positions[t] = req.all_token_ids[start], start
                slots[t] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + q)
                input_ids[t : t + q] = req.all_token_ids[start : start + q - len(s.spec_token_ids)] + s.spec_token_ids
                positions[t : t + q] = pos
                slots[t : t + q] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
            t += q
            query_lens.append(q)
            seq_lens.append(start + q)
            n_rows = 1 + len(s.spec_token_ids) if s.samples else 0
            rows += range(t - n_rows, t)
            counts.append(n_rows)
        return StepInputs(input_ids, positions, slots, tables, query_lens, seq_lens, rows, counts)

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over the step's flat batch: replayed from a CUDA graph when it is a decode batch.

        Returns logits for the rows that matter, and how many rows each scheduled request got: 1 for the
        last token of a sequence, 1 + k when k drafts are verified, 0 for an unfinished prefill chunk.
        """
        inputs = self.prepare_inputs(sched, block_tables)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions),
                                self.kv_cache, self._metadata(inputs))
        rows = inputs.logit_rows
        return self.model.compute_logits(hidden if len(rows) == len(hidden) else hidden[rows]), inputs.counts

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[list[int]]:
        """Run one step; for each scheduled request the tokens to append (none for a prefill chunk)."""
        logits, counts = self.forward(sched, block_tables)
        plain = [i for i, s in enumerate(sched.scheduled) if counts[i] == 1 and not s.spec_token_ids]
        offsets = [0, *itertools.accumulate(counts)]  # where each request's logit rows start
        out: list[list[int]] = [[] for _ in sched.scheduled]
        if plain:
            batch = SamplingBatch.from_requests([sched.scheduled[i].request for i in plain], self.device)
            rows = [offsets[i] for i in plain]
            tokens = self.sampler(logits if len(rows) == len(logits) else logits[rows], batch)
            for i, tok in zip(plain, tokens.tolist()):
                out[i] = [tok]
        for i, s in enumerate(sched.scheduled):
            if s.spec_token_ids and counts[i]:
                out[i] = self.verify(logits[offsets[i] : offsets[i] + counts[i]], s)
        return out

    def verify(self, logits: torch.Tensor, s: ScheduledRequest) -> list[int]:
        """Check one request's drafts against the target's k+1 predictions (see rejection_sampler)."""
        req = s.request
        if req.params.greedy:
            return verify_greedy(logits, s.spec_token_ids)
        probs = processed_probs(logits, SamplingBatch.from_requests([req] * len(logits), self.device))
        generator = req.generator or self.sampler.generator_for(self.device)
        return verify_sampled(probs, s.spec_token_ids, req.spec_probs, generator)
