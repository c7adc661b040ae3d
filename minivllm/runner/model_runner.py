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
from minivllm.core.scheduler import ScheduledRequest, SchedulerOutput
from minivllm.model import load_model, read_model_config
from minivllm.sampling import Sampler, SamplingBatch
from minivllm.sampling.rejection_sampler import verify_greedy, verify_sampled
from minivllm.sampling.sampler import processed_probs


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
        peak_extra = self.profile_run()
        free, total = torch.cuda.mem_get_info()
        budget = gpu_kv_budget(total, self.config.gpu_memory_utilization, total - free + peak_extra)
        return num_blocks_for_budget(budget, self.bytes_per_block)

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
        meta = self._metadata([list(range(cache.shape[2]))], [n], [n], list(range(n)))
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device) % mc.max_position_embeddings, cache, meta)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        del cache, hidden
        return torch.cuda.max_memory_allocated() - base if cuda else 0

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
    def forward(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over the step's flat batch.

        Returns logits for the rows that matter, and how many rows each scheduled request got: 1 for the
        last token of a sequence, 1 + k when k drafts are verified, 0 for an unfinished prefill chunk.
        """
        bs = self.config.block_size
        input_ids, positions, slots, tables, query_lens, seq_lens, rows, counts = [], [], [], [], [], [], [], []
        for s in sched.scheduled:
            req, start = s.request, s.num_computed_before
            end = start + s.num_new_tokens
            table = block_tables[req.request_id]
            input_ids += req.all_token_ids[start:end] + s.spec_token_ids
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            n_rows = 1 + len(s.spec_token_ids) if s.samples else 0
            rows += range(len(input_ids) - n_rows, len(input_ids))
            counts.append(n_rows)
        meta = self._metadata(tables, query_lens, seq_lens, slots)
        hidden = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), self.kv_cache, meta)
        return self.model.compute_logits(hidden[rows]), counts

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> list[list[int]]:
        """Run one step; for each scheduled request the tokens to append (none for a prefill chunk)."""
        logits, counts = self.forward(sched, block_tables)
        plain = [i for i, s in enumerate(sched.scheduled) if counts[i] == 1 and not s.spec_token_ids]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        out: list[list[int]] = [[] for _ in sched.scheduled]
        if plain:
            batch = SamplingBatch.from_requests([sched.scheduled[i].request for i in plain], self.device)
            for i, tok in zip(plain, self.sampler(logits[[offsets[i] for i in plain]], batch).tolist()):
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
