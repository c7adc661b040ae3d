"""ModelRunner: owns the weights, the KV cache tensor, the sampler and the drafter; executes one scheduled step.

It sees the step only as `SchedulerOutput` (plain data) and keeps what it needs between steps in a
`RequestState` per request id. All requests' new tokens are flattened into one batch with no padding. Per
token it builds the position and the cache slot to write; per request the block table and context length
the attention kernels read. On a GPU, decode batches replay CUDA graphs instead (see cuda_graphs.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
from minivllm.core.step_io import RunnerOutput, SchedulerOutput, TokenLogprobs
from minivllm.cpu_platform import CpuThreadSizer
from minivllm.model import load_model
from minivllm.runner.request_state import RequestState
from minivllm.sampling import Sampler, SamplingBatch
from minivllm.sampling.persistent_batch import PersistentBatch  # [issue 27] custom logits processors
from minivllm.sampling.rejection_sampler import verify_greedy, verify_sampled
from minivllm.sampling.sampler import apply_logits_processors, processed_probs
from minivllm.structured_output import apply_grammar_bitmask

LogitsObserver = Callable[[list[str], torch.Tensor], None]


@dataclass(slots=True)
class ForwardItem:
    """One sequence's share of a forward pass: which of its tokens to compute, and where its blocks are."""

    token_ids: list[int]  # the sequence's known tokens (drafts excluded)
    num_computed: int  # tokens already in the cache
    num_new: int  # tokens to compute now, drafts included
    block_table: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    all_logits: bool = False  # logits for every new token, not only the sampled ones (prompt logprobs)

    @property
    def samples(self) -> bool:
        """Only a pass that reaches the end of the known tokens produces logits worth sampling."""
        return self.num_computed + self.num_new - len(self.spec_token_ids) == len(self.token_ids)

    @property
    def num_logit_rows(self) -> int:
        if self.all_logits:
            return self.num_new
        return 1 + len(self.spec_token_ids) if self.samples else 0


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
    def __init__(self, config: EngineConfig) -> None:
        """`config` must be resolved (EngineConfig.resolve): its model config, dtype and max_model_len are final."""
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors say cuda:0: so must we, or
            self.device = torch.device("cuda", torch.cuda.current_device())  # device checks would never match
        self.model_config = mc = config.model_config
        self.dtype = config.dtype
        # CPU: torch's threads follow the cores other processes leave free, unless cpu_threads fixes them
        self.thread_sizer = CpuThreadSizer(fixed=config.cpu_threads) if self.device.type == "cpu" else None
        self.backend = get_attention_backend(config.attention_backend, config.device,
                                             config.hooks.online_softmax_update)
        self.model = load_model(config.model, mc, self.backend, self.dtype, config.device)
        self.sampler = Sampler(config.seed, config.hooks.top_p)
        self.logits_processors = PersistentBatch(config, self.device)  # [issue 27]
        self.requests: dict[str, RequestState] = {}
        self.logits_observers: list[LogitsObserver] = []
        self.bytes_per_block = kv_bytes_per_block(mc.num_layers, config.block_size, mc.num_kv_heads,
                                                  mc.head_dim, self.dtype.itemsize)
        # a draft model is loaded after our cache: size the cache so that its weights and blocks still fit
        from minivllm.spec_decode import draft_memory_needs, make_proposer

        self.reserved_bytes, self.companion_bytes_per_block = draft_memory_needs(config)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        if self.num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower the model size or raise the budget")
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]; zeros so unused slots are never NaN
        self.kv_cache = torch.zeros(mc.num_layers, 2, self.num_blocks, config.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
        self.host_kv_cache = self._host_cache()  # swapped-out blocks (core/swap.py); None without swap
        self.num_host_blocks = 0 if self.host_kv_cache is None else self.host_kv_cache.shape[2]
        self.swap_bytes = 0  # KV bytes copied between the GPU cache and the host cache, each way summed
        self.swap_seconds = 0.0
        self.graphs = None  # DecodeGraphs, where they can run
        self.capture_decode_graphs()
        self.proposer = make_proposer(config, self.num_blocks, mc.vocab_size)

    def _blocks_from_memory(self) -> int:
        """As many blocks as the budget holds, but no more than the sequences could ever fill."""
        cfg = self.config
        return min(self._blocks_in_budget(), max_useful_blocks(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size))

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

    def _host_cache(self) -> torch.Tensor | None:
        """The host blocks for preemption by swap: `swap_space` GiB (pinned on CUDA, so copies use DMA), capped
        at the blocks the sequences could ever fill. `empty`: pages are only touched when blocks land there."""
        cfg, mc = self.config, self.model_config
        if cfg.preemption_mode != "swap":
            return None
        num = min(num_blocks_for_budget(int(cfg.swap_space * 2**30), self.bytes_per_block),
                  max_useful_blocks(cfg.max_num_seqs, cfg.max_model_len, cfg.block_size))
        return torch.empty(mc.num_layers, 2, num, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype=self.dtype,
                           pin_memory=self.device.type == "cuda")

    def swap_blocks(self, sched: SchedulerOutput) -> None:
        """Move blocks before the forward pass, as the scheduler chose them by id: swap-outs to the host first
        (their GPU blocks may be handed to someone else in this very step), then copy-on-write copies, then
        swap-ins back from the host."""
        if not (sched.blocks_to_swap_out or sched.blocks_to_copy or sched.blocks_to_swap_in):
            return
        start = time.perf_counter()
        for pairs, src_cache, dst_cache in ((sched.blocks_to_swap_out, self.kv_cache, self.host_kv_cache),
                                            (sched.blocks_to_copy, self.kv_cache, self.kv_cache),
                                            (sched.blocks_to_swap_in, self.host_kv_cache, self.kv_cache)):
            if pairs:
                src = torch.tensor([a for a, _ in pairs], device=src_cache.device)
                dst = torch.tensor([b for _, b in pairs], device=dst_cache.device)
                dst_cache.index_copy_(2, dst, src_cache.index_select(2, src).to(dst_cache.device))
                if src_cache is not dst_cache:
                    self.swap_bytes += len(pairs) * self.bytes_per_block
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.swap_seconds += time.perf_counter() - start

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

    def capture_decode_graphs(self) -> None:
        """Record decode steps as CUDA graphs, where they can run (CUDA, Triton backend, not enforce_eager)."""
        cfg = self.config
        max_model_len = cfg.max_model_len
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

    # ---- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step: the tokens each request gets (accepted drafts + 1; none for a prefill chunk), their
        logprobs where asked, and, with a drafter, the drafts the next step will verify."""
        self._update_states(sched)
        if self.thread_sizer is not None:
            self.thread_sizer.update()
        self.swap_blocks(sched)
        if not sched.scheduled:  # nothing to compute: only finished requests to forget
            return RunnerOutput()
        states = [self.requests[s.request_id] for s in sched.scheduled]
        items = [ForwardItem(st.token_ids, s.num_computed_before, s.num_new_tokens, st.block_table,
                             s.spec_token_ids, st.params.prompt_logprobs is not None
                             and s.num_computed_before < st.num_prompt_tokens - 1)
                 for s, st in zip(sched.scheduled, states)]
        start = time.perf_counter()
        logits, counts = self.forward(items)
        forward_seconds = time.perf_counter() - start
        ends = list(itertools.accumulate(counts))  # each request's logit rows end here
        # the rows each request samples from: its last one, or the last 1 + k when it verifies k drafts
        sample_rows = [range(ends[i] - (1 + len(it.spec_token_ids)), ends[i]) if it.samples else range(0)
                       for i, it in enumerate(items)]
        out = RunnerOutput(forward_seconds=forward_seconds)
        raw = self._prompt_logprobs_and_raw(logits, items, states, ends, sample_rows, out)
        if sched.grammar_bitmask is not None:  # structured output: invalid continuations are -inf
            index = {st.request_id: i for i, st in enumerate(states)}
            for rid, first in sched.grammar_rows.items():
                rows = sample_rows[index[rid]]
                apply_grammar_bitmask(logits[rows.start : rows.stop], sched.grammar_bitmask[first : first + len(rows)])
        plain = [i for i, it in enumerate(items) if it.samples and not it.spec_token_ids]
        if plain:
            rows = [sample_rows[i].start for i in plain]
            plain_logits = logits if len(rows) == len(logits) else logits[rows]
            for observe in self.logits_observers:
                observe([states[i].request_id for i in plain], plain_logits)
            plain_logits = self.logits_processors.apply([states[i].request_id for i in plain], plain_logits)  # [27]
            batch = self._sampling_batch([states[i] for i in plain])
            for i, tok in zip(plain, self.sampler(plain_logits, batch).tolist()):
                out.sampled_token_ids[states[i].request_id] = [tok]
        for i, it in enumerate(items):
            if it.spec_token_ids and it.samples:
                rows = sample_rows[i]
                out.sampled_token_ids[states[i].request_id] = self.verify(logits[rows.start : rows.stop], states[i],
                                                                          it.spec_token_ids)
        for i, (s, st) in enumerate(zip(sched.scheduled, states)):
            tokens = out.sampled_token_ids.get(s.request_id, [])
            if i in raw:
                out.logprobs[s.request_id] = [token_logprobs(raw[i][j], tok, st.params.logprobs)
                                              for j, tok in enumerate(tokens)]
            rejected = len(s.spec_token_ids) - (len(tokens) - 1) if s.spec_token_ids else 0
            st.num_computed_tokens = s.num_computed_before + s.num_new_tokens - rejected
            st.token_ids.extend(tokens)
            st.spec_probs = None
        if self.proposer is not None:
            self._propose([st for st in states if st.request_id in out.sampled_token_ids], out)
        return out

    def _prompt_logprobs_and_raw(self, logits: torch.Tensor, items: list[ForwardItem], states: list[RequestState],
                                 ends: list[int], sample_rows: list[range], out: RunnerOutput) -> dict:
        """Logprobs from the model's raw logits (before grammar, penalties, temperature), for the requests that
        asked: prompt positions go straight into `out`; the sample rows' log-softmax is returned by batch index,
        for the tokens about to be chosen. One log_softmax over just those rows: no cost to anyone else."""
        raw = {}
        for i, (it, st) in enumerate(zip(items, states)):
            wants_sample = st.params.logprobs is not None and len(sample_rows[i])
            if not (wants_sample or it.all_logits):
                continue
            first = ends[i] - it.num_logit_rows
            logprobs = torch.log_softmax(logits[first : ends[i]].float(), dim=-1)
            if wants_sample:
                raw[i] = logprobs[sample_rows[i].start - first :]
            if it.all_logits:  # row j sits at position num_computed + j and predicts the next prompt token
                start, done = it.num_computed, st.num_prompt_logprobs_done
                targets = range(max(start + 1, done), min(start + it.num_new + 1, st.num_prompt_tokens))
                out.prompt_logprobs[st.request_id] = [
                    token_logprobs(logprobs[t - 1 - start], st.token_ids[t], st.params.prompt_logprobs)
                    for t in targets]
                st.num_prompt_logprobs_done = max(done, targets.stop)
        return raw

    def _sampling_batch(self, states: list[RequestState], rows: int | None = None) -> SamplingBatch:
        """The sampling parameters of these requests (or of one request repeated over `rows` rows)."""
        if rows is not None:
            states = states * rows
        return SamplingBatch.build([st.params for st in states], [st.token_ids for st in states], self.device,
                                   [st.generator for st in states], [st.num_prompt_tokens for st in states],
                                   [st.eos_token_ids for st in states])

    def _update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished requests, take in new ones, and extend the tables of the others."""
        for rid in sched.finished:
            self.requests.pop(rid, None)
        for rid in [*sched.finished, *sched.preempted]:  # a preempted request is recomputed: its drafts go too
            self.logits_processors.remove_request(rid)  # [issue 27]
            if self.proposer is not None:
                self.proposer.free(rid)
        for new in sched.new_requests:
            old = self.requests.get(new.request_id)  # back after a preemption: keep its random stream
            generator = old.generator if old is not None else self._generator(new.seed)
            self.requests[new.request_id] = RequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.params, list(new.block_ids),
                new.max_total_tokens, eos_token_ids=new.eos_token_ids, generator=generator,
                num_prompt_logprobs_done=old.num_prompt_logprobs_done if old is not None else 1)
            self.logits_processors.add_request(new.request_id, new.params, self.requests[new.request_id].token_ids,
                                               new.num_prompt_tokens)  # [issue 27]
        for rid, blocks in sched.new_block_ids.items():
            self.requests[rid].block_table.extend(blocks)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded request's own random stream."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def _propose(self, states: list[RequestState], out: RunnerOutput) -> None:
        """Drafts for every request that just sampled, never past its max_tokens (see spec_decode)."""
        k = self.config.num_speculative_tokens
        budget = [0 if st.params.position_dependent else  # e.g. a penalty would differ per draft position
                  max(min(k, st.max_total_tokens - len(st.token_ids) - 1), 0) for st in states]
        start = time.perf_counter()
        for st, (drafts, probs) in zip(states, self.proposer.propose(states, budget)):
            st.spec_probs = probs
            if drafts:
                out.spec_token_ids[st.request_id] = drafts
        out.propose_seconds = time.perf_counter() - start

    def prepare_inputs(self, items: Sequence[ForwardItem]) -> StepInputs:
        """Flatten the step on the host: each token's id, position and cache slot; each request's table."""
        bs = self.config.block_size
        n = sum(it.num_new for it in items)
        input_ids, positions, slots = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        tables = np.zeros((len(items), max(len(it.block_table) for it in items)), dtype=np.int32)
        query_lens, seq_lens, rows, counts = [], [], [], []
        t = 0  # where this request's tokens start in the flat batch
        for i, it in enumerate(items):
            start, q, table = it.num_computed, it.num_new, it.block_table
            tables[i, : len(table)] = table
            if q == 1:  # a decode (most of them): plain integers are faster than building arrays
                input_ids[t], positions[t] = it.token_ids[start], start
                slots[t] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + q)
                input_ids[t : t + q] = it.token_ids[start : start + q - len(it.spec_token_ids)] + it.spec_token_ids
                positions[t : t + q] = pos
                slots[t : t + q] = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
            t += q
            query_lens.append(q)
            seq_lens.append(start + q)
            n_rows = it.num_logit_rows
            rows += range(t - n_rows, t)
            counts.append(n_rows)
        return StepInputs(input_ids, positions, slots, tables, query_lens, seq_lens, rows, counts)

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over the step's flat batch: replayed from a CUDA graph when it is a decode batch.

        Returns logits for the rows that matter, and how many rows each item got: 1 for the last token of
        a sequence, 1 + k when k drafts are verified, 0 for an unfinished prefill chunk.
        """
        inputs = self.prepare_inputs(items)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(self._to_device(inputs.input_ids), self._to_device(inputs.positions),
                                self.kv_cache, self._metadata(inputs))
        rows = inputs.logit_rows
        return self.model.compute_logits(hidden if len(rows) == len(hidden) else hidden[rows]), inputs.counts

    def verify(self, logits: torch.Tensor, state: RequestState, drafts: list[int]) -> list[int]:
        """Check one request's drafts against the target's k+1 predictions (see rejection_sampler)."""
        params = state.params
        batch = None if params.greedy and not (params.logit_bias or params.allowed_token_ids) else \
            self._sampling_batch([state], rows=len(logits))
        if batch is not None:  # logit_bias, allowed_token_ids: the same at every position
            logits = apply_logits_processors(logits, batch)
        if params.greedy:
            return verify_greedy(logits, drafts)
        probs = processed_probs(logits, batch, self.sampler.top_p_filter)
        draft_probs = None if state.spec_probs is None else state.spec_probs[: len(drafts)]  # budget may cut
        generator = state.generator or self.sampler.generator_for(self.device)
        return (self.config.hooks.verify_sampled or verify_sampled)(probs, drafts, draft_probs, generator)


def token_logprobs(row: torch.Tensor, token: int, k: int | None) -> TokenLogprobs:
    """One position's logprobs from its log-softmax row: the token that is there, then the top k (-1: all)."""
    k = row.shape[-1] if k is None or k < 0 else k
    top = row.topk(k) if k else None
    chosen = float(row[token])
    rank = int((row > row[token]).sum()) + 1
    ids, values = ([token] + top.indices.tolist(), [chosen] + top.values.tolist()) if top is not None else \
        ([token], [chosen])
    return TokenLogprobs(ids, values, [rank] + list(range(1, k + 1)))
