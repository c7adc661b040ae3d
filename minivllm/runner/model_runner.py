"""ModelRunner: owns the weights, the KV cache tensor and the sampler; executes one scheduled step.

All requests' new tokens are flattened into one batch with no padding. Per token it builds the position
and the cache slot to write; per request the block table and context length the attention kernels read.
"""

from __future__ import annotations

import torch

from minivllm.attention import AttentionMetadata, get_attention_backend
from minivllm.config import EngineConfig
from minivllm.core.kv_sizing import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    gpu_kv_budget,
    kv_bytes_per_block,
    num_blocks_for_budget,
)
from minivllm.core.scheduler import SchedulerOutput
from minivllm.model import load_model, read_model_config
from minivllm.sampling import Sampler, SamplingBatch


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
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

    def _blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            return num_blocks_for_budget(budget, self.bytes_per_block)
        if self.config.kv_cache_memory_bytes:
            return num_blocks_for_budget(self.config.kv_cache_memory_bytes, self.bytes_per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run()
        free, total = torch.cuda.mem_get_info()
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = gpu_kv_budget(total, self.config.gpu_memory_utilization, total - free + peak_extra)
        return num_blocks_for_budget(budget, self.bytes_per_block)

    def _profile_run(self) -> None:
        """One forward pass at the largest step size, to measure the activation peak."""
        n, mc, bs = self.config.max_num_batched_tokens, self.model_config, self.config.block_size
        cache = torch.zeros(mc.num_layers, 2, -(-n // bs), bs, mc.num_kv_heads, mc.head_dim,
                            dtype=self.dtype, device=self.device)
        meta = self._metadata([list(range(cache.shape[2]))], [n], [n], list(range(n)))
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device) % mc.max_position_embeddings, cache, meta)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        del cache

    def _metadata(self, tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
                  slots: list[int]) -> AttentionMetadata:
        dev, width = self.device, max(len(t) for t in tables)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[int]:
        """Run one step; returns one new token per scheduled request that reached its sequence's end."""
        bs = self.config.block_size
        input_ids, positions, slots, tables, query_lens, seq_lens, last_rows = [], [], [], [], [], [], []
        for s in sched.scheduled:
            req, start = s.request, s.num_computed_before
            end = start + s.num_new_tokens
            table = block_tables[req.request_id]
            input_ids += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                last_rows.append(len(input_ids) - 1)
        meta = self._metadata(tables, query_lens, seq_lens, slots)
        hidden = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), self.kv_cache, meta)
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[last_rows])
        return self.sampler(logits, SamplingBatch.from_requests(sampling, self.device)).tolist()
