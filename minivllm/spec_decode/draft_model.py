"""Draft-model proposer: a small model with its own paged KV cache guesses the next k tokens.

The draft runs inside the same engine with the same parts as the target: a ModelRunner (weights, a KV cache
tensor, the attention backend) and a KVCacheManager for its block tables. Per request it remembers how
many tokens its cache holds. Each round it first catches up on the tokens the target accepted since last
time (a small prefill, batched across requests), then decodes k - 1 more tokens one at a time.

After verification only the drafts the target accepted are still valid in the draft's cache: its count is
cut back to the target's, and the next catch-up overwrites the rest (the rollback).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_sizing import kv_bytes_per_block
from minivllm.core.scheduler import ScheduledRequest, SchedulerOutput
from minivllm.model import read_model_config
from minivllm.request import Request
from minivllm.runner.model_runner import ModelRunner
from minivllm.sampling.sampler import SamplingBatch, processed_probs


def draft_extra_blocks(target_config: EngineConfig, num_speculative_tokens: int) -> int:
    """Blocks the draft needs beyond one per target block: each sequence's drafts may spill into new ones."""
    return target_config.max_num_seqs * (-(-num_speculative_tokens // target_config.block_size) + 1)


def draft_memory_needs(path: str | Path, target_config: EngineConfig, num_speculative_tokens: int) -> tuple[int, int]:
    """GPU memory the draft will take once the target's KV cache exists: (fixed bytes, bytes per target block).

    The draft mirrors the target's cache block for block, so the target must size its cache for both:
    fixed = the draft's weights (by checkpoint size, rescaled to the dtype it will run in) plus its extra
    blocks; per block = one draft KV block.
    """
    mc = read_model_config(path)
    dtype = target_config.resolve_dtype(mc.torch_dtype)
    per_block = kv_bytes_per_block(mc.num_layers, target_config.block_size, mc.num_kv_heads, mc.head_dim,
                                   dtype.itemsize)
    stored = mc.torch_dtype.itemsize if mc.torch_dtype is not None else 4
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) * dtype.itemsize // stored
    return weights + draft_extra_blocks(target_config, num_speculative_tokens) * per_block, per_block


class DraftModelProposer:
    def __init__(self, path: str, target_config: EngineConfig, vocab_size: int, num_speculative_tokens: int,
                 num_target_blocks: int) -> None:
        self.k = num_speculative_tokens
        bs = target_config.block_size
        # room for every token the target holds plus each sequence's drafts
        blocks = num_target_blocks + draft_extra_blocks(target_config, num_speculative_tokens)
        config = replace(target_config, model=path, num_kv_blocks=blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(config)
        if self.runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"draft model {path} has vocab size {self.runner.model_config.vocab_size}, "
                             f"the target has {vocab_size}: they must share a tokenizer")
        self.runner.capture_decode_graphs(target_config.max_model_len)  # the draft's k - 1 decode steps
        self.kv = KVCacheManager(blocks, bs, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}  # the draft's view of each request: tokens + drafts so far

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int]) -> None:
        """Set `spec_token_ids` and `spec_probs` (the draft's distributions) on each request."""
        shadows = []
        for req in requests:
            shadow = self.shadows.get(req.request_id)
            computed = min(shadow.num_computed_tokens, req.num_computed_tokens) if shadow else 0
            shadow = self.shadows[req.request_id] = replace(
                req, prompt_token_ids=list(req.all_token_ids), output_token_ids=[], num_computed_tokens=computed,
                generator=req.generator)
            shadows.append(shadow)
            req.spec_token_ids, req.spec_probs = [], None
        active = [(r, s, k) for r, s, k in zip(requests, shadows, num_drafts) if k > 0]
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in active}
        for step in range(max((k for _, _, k in active), default=0)):
            batch = [(r, s) for r, s, k in active if k > step and self._allocate(s)]
            if not batch:
                break
            sched = SchedulerOutput([ScheduledRequest(s, s.num_tokens - s.num_computed_tokens, s.num_computed_tokens)
                                     for _, s in batch])
            logits, _ = self.runner.forward(sched, self.kv.block_tables)
            tokens, q = self._sample(logits, [r for r, _ in batch])
            for (req, shadow), tok, dist in zip(batch, tokens, q):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.append_output(tok)
                req.spec_token_ids.append(tok)
                probs[req.request_id].append(dist)
        for req, _, _ in active:
            if not req.params.greedy and probs[req.request_id]:
                req.spec_probs = torch.stack(probs[req.request_id])
            req.num_spec_proposed += len(req.spec_token_ids)

    def _allocate(self, shadow: Request) -> bool:
        return self.kv.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens)

    def _sample(self, logits: torch.Tensor, requests: list[Request]):
        """Greedy requests draft the argmax; sampling ones draw from the draft's processed distribution q."""
        batch = SamplingBatch.from_requests(requests, self.runner.device)
        probs = None if batch.all_greedy else processed_probs(logits, batch)
        tokens, dists = [], []
        argmax = logits.argmax(dim=-1).tolist()  # one device-to-host copy for all greedy rows
        for i, req in enumerate(requests):
            if req.params.greedy:
                tokens.append(argmax[i])
                dists.append(None)
            else:
                gen = req.generator or self.runner.sampler.generator_for(self.runner.device)
                tokens.append(int(torch.multinomial(probs[i], 1, generator=gen)))
                dists.append(probs[i])
        return tokens, dists

    def free(self, request_id: str) -> None:
        """The request finished, was aborted or was preempted: drop its draft cache too."""
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
