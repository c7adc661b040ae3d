"""LLMEngine: one step of the engine, and the parts it wires together. It owns no stage itself:

    add_request: InputProcessor (validate, tokenize) -> Sequence(WAITING) -> Scheduler.waiting
    step():      core_step(): Scheduler.schedule()                  -> SchedulerOutput
                              ModelRunner.execute(scheduler_output) -> RunnerOutput (tokens, drafts)
                              Scheduler.update_from_output(...)     -> EngineCoreOutputs (stops)
                 OutputProcessor.process(...)        -> RequestOutputs (text, stop strings)
                 notify(StepRecord)                  (the trace the widgets draw, the counters)

`core_step` is vLLM's EngineCore.step: token ids only, no text. Beam search drives it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduling_policy import make_policy
from minivllm.core.sequence import FinishReason
from minivllm.core.swap import SwapSpace
from minivllm.engine.input_processor import EngineRequest, InputProcessor, PromptType
from minivllm.engine.metrics import ServerMetrics
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.stats import StepCounters
from minivllm.engine.trace import StepRecord, TraceRecorder
from minivllm.executor.driver import TensorParallelRunner
from minivllm.executor.workers import run_torchrun_worker, torchrun_rank
from minivllm.model import generation_defaults
from minivllm.outputs import RequestOutput
from minivllm.runner.model_runner import ModelRunner
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode import draft_memory_needs, make_proposer
from minivllm.structured_output import StructuredOutputManager
from minivllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from minivllm.engine.arg_utils import EngineArgs

StepObserver = Callable[["LLMEngine", StepRecord], None]

__all__ = ["LLMEngine", "PromptType", "StepObserver"]


class LLMEngine:
    def __init__(self, config: EngineConfig, data_parallel_rank: int | None = None) -> None:
        """`data_parallel_rank`: which of data_parallel_size engines this is (LLM runs them all:
        engine/data_parallel.py); without it only data_parallel_size=1 is accepted."""
        if config.data_parallel_size > 1 and data_parallel_rank is None:
            raise ValueError("data_parallel_size > 1 runs N engines, each an LLMEngine: LLM(...) "
                             "and `minivllm serve` start them (their data_parallel.py)")
        self.config = config = config.resolve()
        # torchrun's rank > 0 is a worker, never an engine: this exits when rank 0 shuts down
        if config.tensor_parallel_size > 1 and torchrun_rank(config):
            run_torchrun_worker(config)
        # a draft model is loaded after our cache: size the cache so its weights and blocks fit too
        self.runner = (ModelRunner(config, draft_memory_needs(config))
                       if config.tensor_parallel_size == 1 else
                       TensorParallelRunner(config))  # this process is rank 0 (distributed/)
        mc = config.model_config
        self.runner.proposer = make_proposer(config, self.runner.num_blocks, mc.vocab_size)
        # a file: a GGUF model, tokenizer inside
        has_tokenizer = Path(config.tokenizer).is_file() or any(
            (Path(config.tokenizer) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        self.tokenizer = (Tokenizer(config.tokenizer, config.hooks.keep_token) if has_tokenizer
                          else None)
        # a GGUF file's metadata names its end token (transformers 5.17 gives its tokenizer <s>)
        from_file = mc.gguf and mc.eos_token_id is not None
        eos = mc.eos_token_id if from_file or not self.tokenizer else self.tokenizer.eos_token_id
        self.eos_token_ids, self.default_sampling_overrides = generation_defaults(
            config.model, eos, config.generation_config == "auto")
        structured = (StructuredOutputManager(self.tokenizer.hf, mc.vocab_size, self.eos_token_ids)
                      if self.tokenizer else None)
        self.input_processor = InputProcessor(config, self.tokenizer, self.eos_token_ids,
                                              self.runner.num_blocks, structured)
        # a table per group of layers: a sliding group's blocks leave with the window (kv_groups.py)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching, config.hooks, config.kv_groups)
        # empty unless preemption_mode="swap"
        self.swap = SwapSpace(self.runner.block_copier.num_host_blocks)
        policy = make_policy(config.scheduling_policy, config.round_robin_quantum,
                             config.sjf_aging_steps, config.hooks.predict_output_tokens)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, policy,
                                   self.swap if config.preemption_mode == "swap" else None,
                                   structured, config.hooks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.counters = StepCounters()
        self.trace_recorder = TraceRecorder(config.trace_steps or 0)
        self.observers: list[StepObserver] = [self.counters, self.trace_recorder]
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step
        # what LLM.get_metrics() and a server's /metrics read (vLLM's names)
        self.metrics = ServerMetrics(config.served_model_name)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None,
                         stat_loggers: Any = None,
                         enable_multiprocessing: bool = False) -> LLMEngine:
        """vLLM's constructor from EngineArgs. `usage_context` is accepted and ignored; stat
        loggers and a separate engine process are not implemented (add_step_observer is ours)."""
        if stat_loggers is not None:
            raise ValueError("stat_loggers is not supported by minivllm: use "
                             "engine.add_step_observer(fn)")
        if enable_multiprocessing:
            raise ValueError("enable_multiprocessing=True is not supported: minivllm's engine runs "
                             "in-process")
        return cls(engine_args.create_engine_config())

    @property
    def trace(self):
        """The recent steps as StepTraces (oldest first), for the widgets and the journey."""
        return self.trace_recorder.steps

    @property
    def num_steps(self) -> int:
        return self.counters.num_steps

    @property
    def eos_token_id(self) -> int | None:
        """The main EOS id (the tokenizer's); `eos_token_ids` has every id that ends a sequence."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call `observer(engine, record)` after every step that ran the model (trace.py)."""
        self.observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    # ---- requests in and out ---------------------------------------------------------------------
    def process_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None, priority: int = 0) -> EngineRequest:
        """Validate and tokenize a request without queueing it, so a batch can be checked before any
        goes in. `priority` (scheduling_policy="priority" only): lower runs first, as in vLLM."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.input_processor.process(request_id, prompt, params, arrival_time, priority)

    def enqueue(self, request: EngineRequest) -> None:
        self.output_processor.add_request(request)
        for seq in request.sequences:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self.enqueue(self.process_request(request_id, prompt, params, arrival_time, priority))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests (one id or several) wherever they are; their blocks go back at once, their
        outputs come with the next step. Unknown or finished ids are ignored, as in vLLM."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            sequence_ids, output = self.output_processor.abort(rid)
            self.scheduler.finish_requests(sequence_ids, FinishReason.ABORT)
            if output is not None:
                self._pending.append(output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and turn new tokens into outputs for every request."""
        outputs, self._pending = self._pending, []
        record = self.core_step()
        if record is not None:
            start = time.perf_counter()
            new_outputs, stopped = self.output_processor.process(record.core_outputs)
            self.scheduler.finish_requests(list(stopped), FinishReason.STOP, stopped)
            record.finished.update(dict.fromkeys(stopped, FinishReason.STOP))
            record.phase_seconds["output"] = time.perf_counter() - start
            record.duration_s += record.phase_seconds["output"]
            self.notify(record)
            outputs += new_outputs
        # what get_metrics() and a server's /metrics read
        self.metrics.observe(outputs, self.stats())
        return outputs

    def core_step(self) -> StepRecord | None:
        """Schedule, run the model, advance the sequences (token ids and token-level stops, no
        text); None when the model did not run. Step observers are not called: `step` (or whoever
        drives this) does that."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output:
            return None
        scheduled_at = time.perf_counter()
        runner_output = self.runner.execute(scheduler_output)
        ran_at = time.perf_counter()
        if not (scheduler_output.scheduled or scheduler_output.preempted):
            return None  # the step only forgot finished sequences
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        end = time.perf_counter()
        finished = {c.request_id: c.finish_reason for c in core_outputs if c.finish_reason}
        phases = {"schedule": scheduled_at - start, "run": ran_at - scheduled_at,
                  "update": end - ran_at}
        return StepRecord(self.num_steps, end - start, scheduler_output, runner_output,
                          core_outputs, finished, self.kv.drain_events(), phases)

    def check_health(self) -> None:
        """Raise if a tensor-parallel worker died (vLLM's check_health)."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.workers.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also at exit or garbage
        collection, so no module globals: this may run from __del__)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def notify(self, record: StepRecord) -> None:
        """Hand a step's record to every step observer (the trace, the counters, yours)."""
        for observe in self.observers:
            observe(self, record)

    # ---- numbers and the cache -------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (benchmarks, or after changing weights); False, keeping the
        cache, while requests hold blocks, unless `reset_running_requests`."""
        return self.kv.reset_prefix_cache(reset_running_requests)

    def stats(self) -> dict:
        kv = self.kv
        return {
            "num_total_blocks": kv.pool.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_total_host_blocks": self.swap.num_blocks,
            "num_free_host_blocks": self.swap.num_free_blocks,
            "num_blocks_swapped_out": self.swap.num_swapped_out,
            "num_blocks_swapped_in": self.swap.num_swapped_in,
            "num_forked_blocks": kv.num_forked_blocks,  # blocks forks shared rather than copied
            "num_cow_copies": kv.num_cow_copies,  # blocks copied on a write into a shared one
            **self.counters.as_dict(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": kv.prefix_cache_hits / max(kv.prefix_cache_queries, 1),
        }

