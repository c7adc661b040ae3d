"""LLMEngine: the loop that wires tokenizer, scheduler, KV-cache manager and model runner together.

    add_request -> Request(WAITING) -> step(): schedule -> execute -> update -> RequestOutput

It is the only place that knows all the parts; each of them knows only its own job.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.trace import ScheduledEntry, StepTrace, group_events
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.request import Request
from minivllm.runner.model_runner import ModelRunner
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.tokenizer import Tokenizer, find_stop_string

PromptType = str | list[int] | dict


def visible_text(req: Request) -> str:
    """The text so far, minus a tail that might still turn out to start a stop string.

    A stop string is cut from the output when it completes, so without this hold-back a stream could
    already have shown its first characters. Held back, the text a caller sees only ever grows.
    """
    if req.is_finished or not req.params.stop_strings:
        return req.output_text
    hold = max(len(s) for s in req.params.stop_strings) - 1
    return req.output_text[: max(len(req.output_text) - hold, 0)]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config, *self._draft_memory(config))
        mc = self.runner.model_config
        has_tokenizer = any((Path(config.model) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        self.tokenizer = Tokenizer(config.model) if has_tokenizer else None
        self.vocab_size = mc.vocab_size
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        if eos is None:
            eos = mc.eos_token_id[0] if isinstance(mc.eos_token_id, list) else mc.eos_token_id
        self.eos_token_id = eos
        capacity = self.runner.num_blocks * config.block_size
        if config.max_model_len is None:
            config.max_model_len = min(mc.max_position_embeddings, capacity)
        elif config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        self.runner.capture_decode_graphs(config.max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.groups: dict[str, list[Request]] = {}  # user request id -> its n sequences
        self.trace: deque[StepTrace] = deque(maxlen=config.trace_steps or 0)
        self._snapshots: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (live table, trace copy)
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        self.num_steps = 0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0
        self.num_spec_proposed = self.num_spec_accepted = self.num_spec_steps = 0
        self.proposer = self._make_proposer(config)

    @staticmethod
    def _draft_memory(config: EngineConfig) -> tuple[int, int]:
        """What a draft model will need on the GPU, so the target's cache leaves room for it (see draft_model)."""
        if config.speculative_model in (None, "[ngram]") or not config.device.startswith("cuda"):
            return 0, 0
        from minivllm.spec_decode.draft_model import draft_memory_needs

        return draft_memory_needs(config.speculative_model, config, config.num_speculative_tokens)

    def _make_proposer(self, config: EngineConfig):
        if config.speculative_model is None:
            return None
        from minivllm.spec_decode import DraftModelProposer, NgramProposer

        if config.speculative_model == "[ngram]":
            return NgramProposer(config.num_speculative_tokens)
        return DraftModelProposer(config.speculative_model, config, self.vocab_size,
                                  config.num_speculative_tokens, self.runner.num_blocks)

    # ---- requests in -------------------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                      arrival_time: float | None = None) -> list[Request]:
        """Validate and tokenize one request (n sequences), without queueing it: errors come before work."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}, "
                             f"which leaves no room for output")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        reqs = []
        for i in range(params.n):
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", list(ids), params, text,
                          self.eos_token_id, max_len, arrival, parent_id=request_id, index=i)
            if params.seed is not None:
                req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            if self.tokenizer is not None:
                req.detokenizer = self.tokenizer.start_detokenizer(len(ids))
            reqs.append(req)
        need = self.kv.blocks_needed(reqs[0].max_total_tokens)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the cache has only "
                             f"{self.kv.pool.num_blocks}: lower max_tokens or add blocks")
        return reqs

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: pass prompt_token_ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def enqueue(self, reqs: list[Request]) -> None:
        self.groups[reqs[0].parent_id] = reqs
        for r in reqs:
            self.scheduler.add(r)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        self.enqueue(self.make_requests(request_id, prompt, params, arrival_time))

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks go back at once, its output comes with the next step."""
        reqs = self.groups.pop(request_id, None)
        if reqs is None:
            return
        for r in reqs:
            if not r.is_finished:
                self.scheduler.finish(r, "abort")
                r.finish_time = time.monotonic()
                self._finish_text(r)
            if self.proposer is not None:
                self.proposer.free(r.request_id)
        self._pending.append(self._output(reqs))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and turn new tokens into outputs for every request touched."""
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if self.proposer is not None:
            for rid in sched.preempted:  # recomputed later, so the draft's cache goes too
                self.proposer.free(rid)
        if not sched:
            return outputs
        new_tokens = self.runner.execute(sched, self.kv.block_tables)
        entries, touched, finished = self._apply_tokens(sched, new_tokens)
        rejected = {s.request.request_id: len(s.spec_token_ids) - (len(toks) - 1)
                    for s, toks in zip(sched.scheduled, new_tokens) if s.spec_token_ids and toks}
        self.scheduler.update_after_step(sched, rejected)
        for s in sched.scheduled:
            if s.request.request_id in finished:
                self.scheduler.finish(s.request, finished[s.request.request_id])
                if self.proposer is not None:
                    self.proposer.free(s.request.request_id)
        for pid in touched:
            reqs = self.groups[pid]
            if reqs[0].params.output_kind is RequestOutputKind.CUMULATIVE or all(r.is_finished for r in reqs):
                outputs.append(self._output(reqs))
        for out in outputs:
            if out.finished:
                self.groups.pop(out.request_id, None)
        if self.proposer is not None:
            self._propose()
        self._record(sched, entries, finished, time.perf_counter() - start)
        self.num_steps += 1
        return outputs

    def _propose(self) -> None:
        """Drafts for every decoding request, verified by the next step (never past max_tokens)."""
        reqs = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        budget = [0 if r.params.repetition_penalty != 1.0 else  # the penalty would differ per draft
                  max(min(self.config.num_speculative_tokens, r.max_total_tokens - r.num_tokens - 1), 0)
                  for r in reqs]
        self.proposer.propose(reqs, budget)

    def _apply_tokens(self, sched: SchedulerOutput, new_tokens: list[list[int]]):
        entries, touched, finished = [], {}, {}
        now = time.monotonic()
        for s, tokens in zip(sched.scheduled, new_tokens):
            req = s.request
            kind = "prefill" if s.is_prefill else "decode"
            if kind == "prefill":
                self.num_prefill_tokens_computed += s.num_new_tokens
            else:
                self.num_decode_tokens += s.num_new_tokens
            entry = ScheduledEntry(req.request_id, s.num_new_tokens, kind, s.num_computed_before,
                                   spec_token_ids=list(s.spec_token_ids))
            entries.append(entry)
            if not tokens:
                continue
            if s.spec_token_ids:
                entry.num_accepted = len(tokens) - 1
                req.num_spec_accepted += entry.num_accepted
                self.num_spec_proposed += len(s.spec_token_ids)
                self.num_spec_accepted += entry.num_accepted
                self.num_spec_steps += 1
            if req.first_token_time is None:
                req.first_token_time = now
            for token in tokens:
                req.append_output(token)
                entry.new_token_ids.append(token)
                self.num_generated_tokens += 1
                reason = self._check_stop(req, token)
                if reason is not None:
                    req.finish_time = now
                    finished[req.request_id] = reason
                    self._finish_text(req)
                    break
            entry.sampled_token = entry.new_token_ids[-1]
            touched[req.parent_id] = True
        return entries, touched, finished

    @staticmethod
    def _streams_text(req: Request) -> bool:
        """Text is built token by token only if someone reads it before the end: a stream, or stop strings.

        Otherwise (FINAL_ONLY, as in LLM.generate) it is decoded once when the request finishes: per-token
        detokenization took about 11 us a token on the 2-core test machine, 2.8 ms a step at a batch of 256.
        """
        return req.params.output_kind is RequestOutputKind.CUMULATIVE or bool(req.params.stop_strings)

    def _finish_text(self, req: Request) -> None:
        """A request that did not stream its text gets all of it now, in one decode."""
        if self.tokenizer is not None and not self._streams_text(req):
            req.output_text += self.tokenizer.detokenize_rest(req.all_token_ids, req.detokenizer)

    def _check_stop(self, req: Request, token: int) -> str | None:
        """Update the request's text (when it streams) and say why it should stop now, if it should."""
        params = req.params
        if self.tokenizer is not None and self._streams_text(req):
            before = len(req.output_text)
            req.output_text += self.tokenizer.detokenize_step(req.all_token_ids, req.detokenizer)
            hit = find_stop_string(req.output_text, len(req.output_text) - before, params.stop_strings)
            if hit is not None:
                req.output_text = req.output_text[: hit[0]]
                req.stop_reason = hit[1]
                return "stop"
        if token in params.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if not params.ignore_eos and token == req.eos_token_id:
            return "stop"
        if req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def _output(self, reqs: list[Request]) -> RequestOutput:
        first = reqs[0]
        completions = [CompletionOutput(r.index, visible_text(r), list(r.output_token_ids), r.finish_reason,
                                        r.stop_reason) for r in reqs]
        times = [r.first_token_time for r in reqs if r.first_token_time is not None]
        metrics = RequestMetrics(first.arrival_time, first_token_time=min(times) if times else None,
                                 finished_time=max((r.finish_time or 0) for r in reqs) or None,
                                 spec_num_proposed=sum(r.num_spec_proposed for r in reqs),
                                 spec_num_accepted=sum(r.num_spec_accepted for r in reqs))
        return RequestOutput(first.parent_id, first.prompt, first.prompt_token_ids, completions,
                             all(r.is_finished for r in reqs), max(first.num_cached_tokens, 0), metrics,
                             sum(r.num_preemptions for r in reqs))

    def _record(self, sched: SchedulerOutput, entries, finished, duration: float) -> None:
        if self.trace.maxlen == 0:
            self.kv.drain_events()
            return
        events = self.kv.drain_events()
        pool = self.kv.pool
        tables = self._table_snapshots()
        self.trace.append(StepTrace(
            step=self.num_steps, duration_s=duration, scheduled=entries, preempted=list(sched.preempted),
            finished=finished, allocated=group_events(events, "alloc"), cache_hits=group_events(events, "hit"),
            freed=group_events(events, "free"),
            block_tables=tables,
            waiting=[r.request_id for r in self.scheduler.waiting],
            running=[r.request_id for r in self.scheduler.running],
            num_free_blocks=pool.num_free_blocks, num_total_blocks=pool.num_blocks, block_size=self.kv.block_size,
            num_computed_tokens={r.request_id: r.num_computed_tokens for r in self.scheduler.running},
            # a block used by several requests is in several tables: no need to scan the whole pool
            shared_blocks={b: pool.blocks[b].ref_cnt for t in tables.values() for b in t
                           if pool.blocks[b].ref_cnt > 1}))

    def _table_snapshots(self) -> dict[str, list[int]]:
        """Copies of the block tables for the trace, reusing last step's copy of every table that did not grow.

        A table only grows (appends) until it is freed whole, so the same list object with the same length
        holds the same blocks. Most steps add no block to most tables: this keeps the trace's memory and
        time per step small at large batch sizes. (Copies are shared between steps: read them, never edit.)
        """
        previous, self._snapshots = self._snapshots, {}
        for rid, table in self.kv.block_tables.items():
            old = previous.get(rid)
            unchanged = old is not None and old[0] is table and len(old[1]) == len(table)
            self._snapshots[rid] = old if unchanged else (table, list(table))
        return {rid: copy for rid, (_, copy) in self._snapshots.items()}

    # ---- numbers -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv
        return {
            "num_total_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefill_tokens_computed": self.num_prefill_tokens_computed,
            "num_decode_tokens": self.num_decode_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": kv.prefix_cache_hits / max(kv.prefix_cache_queries, 1),
            "spec_num_proposed": self.num_spec_proposed,
            "spec_num_accepted": self.num_spec_accepted,
            "spec_acceptance_rate": self.num_spec_accepted / max(self.num_spec_proposed, 1),
            # tokens gained per verification step: the accepted drafts plus the target's own token
            "spec_mean_accepted_length": (self.num_spec_accepted + self.num_spec_steps) / max(self.num_spec_steps, 1),
        }
