"""Draft-model proposer: a small model with its own paged KV cache guesses the next k tokens.

The draft runs inside the same engine with the same parts as the target: a ModelRunner (weights, a
KV cache tensor, the attention backend) and a KVCacheManager for its block tables. Per request it
remembers how many tokens its cache holds. Each round it first catches up on the tokens the target
accepted since last time (a small prefill, batched across requests), then decodes k - 1 more tokens
one at a time.

After verification only the drafts the target accepted are still valid in the draft's cache: its
count is cut back to the target's, and the next catch-up overwrites the rest (the rollback).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from minivllm.config import NGRAM, EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_sizing import kv_bytes_per_block
from minivllm.core.math_utils import cdiv
from minivllm.core.sequence import Sequence
from minivllm.model import read_model_config
from minivllm.quantization.kv_cache import kv_cache_torch_dtype
from minivllm.runner.model_runner import ModelRunner
from minivllm.runner.sequence_state import SequenceState
from minivllm.runner.step_batch import StepRow
from minivllm.sampling.sampler import SamplingBatch, first_argmax, processed_probs
from minivllm.spec_decode.proposer import Draft


def draft_extra_blocks(target_config: EngineConfig, num_speculative_tokens: int) -> int:
    """Blocks the draft needs beyond one per target block: drafts may spill into new blocks."""
    return target_config.max_num_seqs * (cdiv(num_speculative_tokens, target_config.block_size) + 1)


def draft_memory_needs(target_config: EngineConfig) -> tuple[int, int]:
    """GPU memory a draft model takes once the target's KV cache exists: (fixed, per target block).
    The draft mirrors the target's cache block for block, so the target must size its cache for
    both: fixed = the draft's weights (by checkpoint size, rescaled to the dtype it will run in)
    plus its extra blocks; per block = one draft KV block. (0, 0) without a draft, or off GPU."""
    path = target_config.speculative_model
    if path in (None, NGRAM) or not target_config.device.startswith("cuda"):
        return 0, 0
    mc = read_model_config(path)
    dtype = target_config.resolve_dtype(mc.torch_dtype)
    cache_dtype = kv_cache_torch_dtype(target_config.kv_cache_dtype, dtype)  # as the target's
    per_block = kv_bytes_per_block(mc.num_layers, target_config.block_size, mc.num_kv_heads,
                                   mc.head_dim, cache_dtype.itemsize)
    stored = mc.torch_dtype.itemsize if mc.torch_dtype is not None else 4
    weights = (sum(f.stat().st_size
                   for f in Path(path).glob("*.safetensors")) * dtype.itemsize // stored)
    extra = draft_extra_blocks(target_config, target_config.num_speculative_tokens)
    return weights + extra * per_block, per_block


class DraftModelProposer:
    def __init__(self, target_config: EngineConfig, vocab_size: int,
                 num_target_blocks: int) -> None:
        self.k = target_config.num_speculative_tokens
        path = target_config.speculative_model
        # the target's dtype, but no quantization: the draft runs as its checkpoint is
        config = replace(target_config, model=path, num_kv_blocks=None, model_config=None,
                         enable_prefix_caching=False, speculative_model=None,
                         num_speculative_tokens=0, dtype=target_config.dtype,
                         quantization=None).resolve()
        # room for every token the target holds plus each sequence's drafts, in each of our groups
        logical = (num_target_blocks // target_config.kv_groups.num_groups
                   + draft_extra_blocks(target_config, self.k))
        blocks = logical * config.kv_groups.num_groups
        config = replace(config, num_kv_blocks=blocks)
        self.runner = ModelRunner(config)  # on a GPU: graphs for its k - 1 decode steps
        if self.runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"draft model {path} has vocab size "
                             f"{self.runner.model_config.vocab_size}, the target has {vocab_size}: "
                             f"they must share a tokenizer")
        self.kv = KVCacheManager(blocks, target_config.block_size, enable_prefix_caching=False,
                                 groups=config.kv_groups)
        self.shadows: dict[str, Sequence] = {}  # the draft's view of a request: tokens + drafts

    @torch.inference_mode()
    def propose(self, requests: list[SequenceState], num_drafts: list[int]) -> list[Draft]:
        """Up to num_drafts[i] tokens for each request, and the draft's distribution q for each."""
        for req in requests:
            shadow = self.shadows.get(req.request_id)
            # the target caches all but its newest token: ours may hold no more (rejected drafts go)
            computed = min(shadow.num_computed_tokens, len(req.token_ids) - 1) if shadow else 0
            self.shadows[req.request_id] = Sequence(req.request_id, list(req.token_ids), req.params,
                                                    num_computed_tokens=computed)
        shadows = [self.shadows[req.request_id] for req in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_drafts) if k > 0]
        for step in range(max((num_drafts[i] for i in active), default=0)):
            batch = [i for i in active if num_drafts[i] > step and self._allocate(shadows[i])]
            if not batch:
                break
            rows = [StepRow(shadows[i].all_token_ids, self.kv.block_tables[shadows[i].request_id],
                            shadows[i].num_computed_tokens,
                            shadows[i].num_tokens - shadows[i].num_computed_tokens)
                    for i in batch]
            logits = self.runner.forward(rows)
            tokens, q = self._sample(logits, [requests[i] for i in batch])
            for i, tok, dist in zip(batch, tokens, q):
                shadows[i].num_computed_tokens = shadows[i].num_tokens
                shadows[i].append_output(tok)
                drafts[i].append(tok)
                dists[i].append(dist)
        return [(d, None if req.params.greedy or not d else torch.stack(q))
                for req, d, q in zip(requests, drafts, dists)]

    def _allocate(self, shadow: Sequence) -> bool:
        return self.kv.allocate(shadow, shadow.num_tokens - shadow.num_computed_tokens)

    def _sample(self, logits: torch.Tensor, requests: list[SequenceState]):
        """Greedy requests draft the argmax; sampling ones draw from the draft's processed q."""
        batch = SamplingBatch.build([r.params for r in requests], [r.token_ids for r in requests],
                                    self.runner.device)
        probs = None if batch.all_greedy else processed_probs(logits, batch)
        tokens, dists = [], []
        argmax = first_argmax(logits).tolist()  # one device-to-host copy for all greedy rows
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
