"""ModelRunner: owns the weights, the KV cache, the sampler and the drafter; executes one step.

It sees the step only as `SchedulerOutput` (plain data) and keeps what it needs between steps in a
`SequenceState` per sequence id. `execute` is a fixed list of phases over one `StepRow` per
scheduled sequence (step_batch.py): each phase reads the rows, does one thing, and writes its result
onto them. Beside it: how many blocks to allocate and moving them (memory.py), logprobs
(logprobs.py) and, on a GPU, decode steps replayed as CUDA graphs (cuda_graphs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.core.kv_sizing import kv_bytes_per_block
from minivllm.core.step_io import RunnerOutput, SchedulerOutput
from minivllm.distributed.parallel import SINGLE, TensorParallel, local_kv_heads
from minivllm.model import load_model
from minivllm.model.moe_layer import expert_load, record_expert_choices
from minivllm.platforms import choose_platform
from minivllm.runner.cuda_graphs import build_decode_graphs
from minivllm.runner.logprobs import raw_logprobs, sampled_logprobs
from minivllm.runner.memory import (
    BlockCopier,
    host_kv_cache,
    kv_cache_shape,
    num_kv_blocks,
    profile_run,
)
from minivllm.runner.sequence_state import SequenceState
from minivllm.runner.step_batch import StepRow, attention_metadata, prepare_inputs, to_device
from minivllm.runner.weight_offload import offload_weights
from minivllm.sampling import Sampler, SamplingBatch
from minivllm.sampling.persistent_batch import PersistentBatch
from minivllm.sampling.rejection_sampler import verify_greedy, verify_sampled
from minivllm.sampling.sampler import apply_logits_processors, processed_probs
from minivllm.structured_output import apply_grammar_bitmask

# spec_decode builds its draft model on a ModelRunner: the runner only needs the interface
if TYPE_CHECKING:
    from minivllm.spec_decode.proposer import Proposer

LogitsObserver = Callable[[list[str], torch.Tensor], None]


class ModelRunner:
    def __init__(self, config: EngineConfig, draft_reserve: tuple[int, int] = (0, 0),
                 tp: TensorParallel = SINGLE) -> None:
        """`config` must be resolved (EngineConfig.resolve): its model config, dtype, max_model_len
        are final. `draft_reserve`: (bytes, bytes per block) a draft model loaded after us will take
        (spec_decode). `tp`: this rank's share of a tensor-parallel model (weights, KV heads)."""
        self.config = config
        self.device = torch.device(config.device)
        # tensors say cuda:0, so must we, or device checks would never match
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = mc = config.model_config
        self.dtype = config.dtype
        # every implementation choice, made once (minivllm/platforms/): attention, layer ops, ...
        self.platform = choose_platform(self.device, self.dtype, config.attention_backend,
                                        config.hooks.online_softmax_update)
        # CPU threads, shared with the other ranks and data-parallel engines
        self.thread_sizer = self.platform.thread_sizer(config.cpu_threads,
                                                       tp.size * config.data_parallel_size)
        # data-parallel engines map one copy of the weights (model/weight_cache.py)
        cache = envs.MINIVLLM_WEIGHT_CACHE_DIR if config.data_parallel_size > 1 else None
        self.model = load_model(config.model, mc, self.platform.implementations, self.dtype,
                                config.device, tp, config.lazy_loading, cache)
        # a MoE model keeps each step's router choices for the trace (tokens per expert per layer)
        self.records_expert_load = bool(config.trace_steps) and record_expert_choices(
            self.model, max(config.max_num_batched_tokens, config.max_num_seqs)
            * (1 + config.num_speculative_tokens))
        offloaded = offload_weights(self.model, config.cpu_offload_gb, self.device)  # (GPU only)
        self.compiled = self.platform.compile(self.model, config.enforce_eager)  # opt-in, CPU
        self.sampler = Sampler(config.seed, config.hooks.top_p)
        self.logits_processors = PersistentBatch(config, self.device)  # vLLM v1's, if any
        self.sequences: dict[str, SequenceState] = {}
        self.logits_observers: list[LogitsObserver] = []
        self.proposer: Proposer | None = None  # the engine hands us one once our cache is sized
        self.cache_dtype = config.cache_dtype  # the model's dtype, or fp8 (kv_cache_dtype)
        # a block holds one group's layers (all of them, unless the model mixes attention kinds)
        self.kv_groups = config.kv_groups
        self.bytes_per_block = kv_bytes_per_block(self.kv_groups.group_size, config.block_size,
                                                  local_kv_heads(mc.num_kv_heads, tp.size),
                                                  mc.head_dim, self.cache_dtype.itemsize)
        # every rank must have every block id the scheduler hands out
        self.num_blocks = tp.min_int(num_kv_blocks(config, self.device, self.bytes_per_block,
                                                   self.profile_run, *draft_reserve))
        if self.num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower the model size or raise the "
                             "budget")
        self.kv_cache = torch.zeros(kv_cache_shape(config, self.num_blocks), dtype=self.cache_dtype,
                                    device=self.device)  # zeros: unused slots are never NaN
        host = host_kv_cache(config, self.cache_dtype, self.bytes_per_block,
                             pin=self.device.type == "cuda")
        self.block_copier = BlockCopier(self.kv_cache, host, self.bytes_per_block)
        # decode steps as CUDA graphs where the platform records them (not collectives: TP is eager)
        self.graphs = (build_decode_graphs(self.model, self.kv_cache, config, self.device)
                       if tp.size == 1
                       and self.platform.captures_graphs(config.enforce_eager or offloaded > 0)
                       else None)

    def profile_run(self) -> int:
        """The activation peak of the largest possible step, in bytes (memory.py; 0 off CUDA)."""
        return profile_run(self.model, self.config, self.cache_dtype, self.device)

    # ---- one step, phase by phase ----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step: each sequence's tokens (accepted drafts + 1; none for a prefill chunk),
        their logprobs where asked, and, with a drafter, the drafts the next step will verify."""
        self.update_states(sched)
        self.block_copier.run(sched)
        if not sched.scheduled:  # nothing to compute: only sequences to forget, or blocks to move
            return RunnerOutput()
        rows = self.step_rows(sched)
        start = time.perf_counter()
        logits = self.forward(rows)
        out = RunnerOutput(forward_seconds=time.perf_counter() - start)
        if self.records_expert_load:  # the batch's tokens (a CUDA graph's padding rows left out)
            out.expert_load = expert_load(self.model, sum(r.num_new for r in rows))
        raw_logprobs(rows, logits, out)  # before anything changes the logits
        self.mask_grammar(rows, logits, sched)
        self.sample(rows, logits)
        self.verify_drafts(rows, logits, out)
        self.commit(rows, out)
        self.propose(rows, out)
        return out

    def update_states(self, sched: SchedulerOutput) -> None:
        """Forget finished sequences, meet new (or preempted) ones, extend the others' tables."""
        if self.thread_sizer is not None:
            self.thread_sizer.update()
        for rid in sched.finished:
            self.sequences.pop(rid, None)
        for rid in [*sched.finished, *sched.preempted]:  # a preempted one is recomputed: drafts go
            self.logits_processors.remove_request(rid)
            if self.proposer is not None:
                self.proposer.free(rid)
        for s in sched.scheduled:
            if s.new is None:
                self.sequences[s.request_id].block_table.extend(s.new_block_ids)
                continue
            old, new = self.sequences.get(s.request_id), s.new  # old: back after a preemption
            if old is not None:  # keeps its random stream and the prompt logprobs it reported
                generator, done = old.generator, old.num_prompt_logprobs_done
            else:  # a seeded sequence draws from its own stream
                generator = (None if new.seed is None
                             else torch.Generator(device=self.device).manual_seed(new.seed))
                done = 1
            st = self.sequences[s.request_id] = SequenceState(
                s.request_id, list(new.token_ids), new.num_prompt_tokens, new.params,
                list(s.new_block_ids), new.max_total_tokens, new.eos_token_ids, done, generator)
            self.logits_processors.add_request(s.request_id, new.params, st.token_ids,
                                               new.num_prompt_tokens)

    def step_rows(self, sched: SchedulerOutput) -> list[StepRow]:
        """One record per scheduled sequence, in batch order: what to compute, as scheduled."""
        rows = []
        for s in sched.scheduled:
            st = self.sequences[s.request_id]
            prompt_logits = (st.params.prompt_logprobs is not None
                             and s.num_computed_before < st.num_prompt_tokens - 1)
            rows.append(StepRow(st.token_ids, st.block_table, s.num_computed_before,
                                s.num_new_tokens, s.spec_token_ids, s.samples, prompt_logits, st))
        return rows

    def forward(self, rows: list[StepRow]) -> torch.Tensor:
        """One forward pass over the step's flat batch (a CUDA graph's replay for a decode batch).
        Returns logits for the rows that matter (each `StepRow.logit_rows` says which are its own):
        1 for a sequence's last token, 1 + k to verify k drafts, 0 for an unfinished chunk."""
        inputs = prepare_inputs(rows, self.config.block_size, self.kv_groups.num_groups)
        if self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(to_device(inputs.input_ids, self.device),
                                to_device(inputs.positions, self.device), self.kv_cache,
                                attention_metadata(inputs, self.device, self.kv_groups))
        wanted = inputs.logit_rows
        return self.model.compute_logits(hidden if len(wanted) == len(hidden) else hidden[wanted])

    def mask_grammar(self, rows: list[StepRow], logits: torch.Tensor,
                     sched: SchedulerOutput) -> None:
        """Structured output: tokens the grammar forbids become -inf (the scheduler's masks)."""
        if sched.grammar_bitmask is None:
            return
        by_id = {r.state.request_id: r for r in rows}
        for rid, first in sched.grammar_rows.items():
            span = by_id[rid].sample_rows
            apply_grammar_bitmask(logits[span.start : span.stop],
                                  sched.grammar_bitmask[first : first + len(span)])

    def sample(self, rows: list[StepRow], logits: torch.Tensor) -> None:
        """Every row that samples without drafts draws its next token: one batched sampler call."""
        plain = [r for r in rows if r.samples and not r.spec_token_ids]
        if not plain:
            return
        index = [r.sample_rows.start for r in plain]
        plain_logits = logits if len(index) == len(logits) else logits[index]
        ids = [r.state.request_id for r in plain]
        for observe in self.logits_observers:
            observe(ids, plain_logits)
        plain_logits = self.logits_processors.apply(ids, plain_logits)
        tokens = self.sampler(plain_logits, self.sampling_batch([r.state for r in plain]))
        for row, token in zip(plain, tokens.tolist()):
            row.sampled = [token]

    def verify_drafts(self, rows: list[StepRow], logits: torch.Tensor, out: RunnerOutput) -> None:
        """Rows with drafts keep the accepted ones plus a token of their own (rejection_sampler)."""
        for row in rows:
            if row.spec_token_ids and row.samples:
                span = row.sample_rows
                row.sampled = self.verify(logits[span.start : span.stop], row.state,
                                          row.spec_token_ids)
                out.num_accepted[row.state.request_id] = len(row.sampled) - 1

    def commit(self, rows: list[StepRow], out: RunnerOutput) -> None:
        """Report each row's tokens (and logprobs), and keep them as the next step's inputs."""
        for row in rows:
            st = row.state
            st.spec_probs = None
            if row.sampled:
                out.sampled_token_ids[st.request_id] = row.sampled
                logprobs = sampled_logprobs(row)
                if logprobs is not None:
                    out.logprobs[st.request_id] = logprobs
                st.token_ids.extend(row.sampled)

    def propose(self, rows: list[StepRow], out: RunnerOutput) -> None:
        """Drafts for every sequence that just sampled, never past its max_tokens (spec_decode)."""
        if self.proposer is None:
            return
        states = [r.state for r in rows if r.sampled]
        k = self.config.num_speculative_tokens
        # none where the sampling depends on the position (a penalty would differ per draft)
        budget = [0 if st.params.position_dependent else
                  max(min(k, st.max_total_tokens - len(st.token_ids) - 1), 0) for st in states]
        start = time.perf_counter()
        for st, (drafts, probs) in zip(states, self.proposer.propose(states, budget)):
            st.spec_probs = probs
            if drafts:
                out.spec_token_ids[st.request_id] = drafts
        out.propose_seconds = time.perf_counter() - start

    # ---- helpers ---------------------------------------------------------------------------------
    def sampling_batch(self, states: list[SequenceState]) -> SamplingBatch:
        """The sampling parameters of these sequences, one row each."""
        return SamplingBatch.build([st.params for st in states], [st.token_ids for st in states],
                                   self.device, [st.generator for st in states],
                                   [st.num_prompt_tokens for st in states],
                                   [st.eos_token_ids for st in states])

    def verify(self, logits: torch.Tensor, state: SequenceState, drafts: list[int]) -> list[int]:
        """Check one sequence's drafts against the target's k+1 predictions (rejection_sampler)."""
        params = state.params
        batch = None if params.greedy and not (params.logit_bias or params.allowed_token_ids) else \
            self.sampling_batch([state] * len(logits))
        if batch is not None:  # logit_bias, allowed_token_ids: the same at every position
            logits = apply_logits_processors(logits, batch)
        if params.greedy:
            return verify_greedy(logits, drafts)
        probs = processed_probs(logits, batch, self.sampler.top_p_filter)
        # the budget may have cut the drafts
        draft_probs = None if state.spec_probs is None else state.spec_probs[: len(drafts)]
        generator = state.generator or self.sampler.generator_for(self.device)
        verify = self.config.hooks.verify_sampled or verify_sampled
        return verify(probs, drafts, draft_probs, generator)
