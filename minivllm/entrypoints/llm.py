"""LLM: the offline API, as in vLLM: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from minivllm.engine.arg_utils import engine_config_from_kwargs
from minivllm.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from minivllm.engine.data_parallel import DataParallelEngines
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.step_driver import StepDriver
from minivllm.entrypoints.profiler import EngineProfiler
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.v1.metrics.reader import Metric, read_metrics


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching underneath.

    Safe to share between threads (vLLM's LLM is not): concurrent `generate` calls join one running
    batch (engine/step_driver.py). With data_parallel_size=N, `generate` deals its prompts over N
    engines; everything else (beam search, aborts, metrics, prefix cache) concerns this process's.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        """`model`: checkpoint directory or Hub id (None: the embedded one); kwargs: EngineArgs."""
        config = engine_config_from_kwargs(model, kwargs)
        # data_parallel_size > 1: engines 1..N-1 load in their own processes while this one loads
        # engine 0; all map one copy of the weights (engine/data_parallel.py)
        self._data_parallel = (DataParallelEngines(config) if config.data_parallel_size > 1
                               else None)
        try:
            self.engine = LLMEngine(config, 0 if self._data_parallel else None)
            if self._data_parallel is not None:
                self._data_parallel.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        # request ids; next() on a count is atomic, so threads may share it
        self._ids = itertools.count()
        self._driver = StepDriver(self.engine)  # lets threads share the engine (step_driver.py)
        self._profiler = EngineProfiler()

    def shutdown(self) -> None:
        """Stop the tensor- and data-parallel worker processes (also on `with` exit and `del`)."""
        engine = getattr(self, "engine", None)  # (absent when __init__ failed)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "_data_parallel", None) is not None:
            self._data_parallel.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine underneath."""
        return self.engine

    @property
    def tokenizer(self):
        """Our wrapper (incremental detokenizing); get_tokenizer() gives the Hugging Face one."""
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The Hugging Face tokenizer, as vLLM's LLM.get_tokenizer() returns."""
        return None if self.engine.tokenizer is None else self.engine.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given none: the checkpoint's generation_config.json sampling
        defaults, as vLLM does."""
        return SamplingParams(**self.engine.default_sampling_overrides)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `priority`: one per
        prompt (scheduling_policy="priority"; lower runs first), as in vLLM."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        params = self._final_only(params)
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            before, t0 = self.engine.counters.as_dict(), time.perf_counter()

            def progress(finished: int) -> None:
                bar.update(finished - bar.n)
                bar.set_postfix_str(self._speed(before, t0), refresh=False)

            if self._data_parallel is not None:  # a share for each engine (no progress shown)
                return self._data_parallel.generate(ids, prompts, params, priority,
                                                    self._driver.run, self._driver.abort)
            return self._driver.run(ids, prompts, params, priority, progress if use_tqdm else None)

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Abort requests a `generate` call (in any thread) is running: that call returns them with
        finish_reason "abort". Ids are RequestOutput.request_id: "0", "1", ... as submitted."""
        self._driver.abort([request_id] if isinstance(request_id, str) else list(request_id))

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's API and scoring) over forked, copy-on-write block tables, on an idle
        engine: one BeamSearchOutput per prompt, best first. (`use_tqdm`: no bar is shown.)"""
        with self._driver.exclusive() as engine:
            return BeamSearch(engine).run(_prompt_list(prompts), params)

    @staticmethod
    def _final_only(params: list) -> list:
        """generate() returns finished requests only, so it asks for nothing else (as vLLM does)."""
        final, copies, out = RequestOutputKind.FINAL_ONLY, {}, []
        for sp in params:
            sp = SamplingParams() if sp is None else sp
            # others fail in process_request
            if isinstance(sp, SamplingParams) and sp.output_kind is not final:
                if id(sp) not in copies:  # one copy per distinct params object, not per prompt
                    copies[id(sp)] = replace(sp, output_kind=final)
                sp = copies[id(sp)]
            out.append(sp)
        return out

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Replies to conversations, formatted by the chat template (the tokenizer's, or given)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        convos = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {}, chat_template=chat_template,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)
        prompts = []
        for convo in convos:
            try:
                text, ids = self.tokenizer.apply_chat_template(convo, **kwargs)
            # no template, or messages that do not fit it: transformers raises many kinds
            except Exception as e:
                raise ValueError(f"chat template failed: {e}") from e
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- vLLM's engine controls (issue 27) -------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        """vllm.v1.metrics.reader's objects: what a server on this engine serves at /metrics."""
        self.engine.metrics.set_gauges(self.engine.stats())
        return read_metrics(self.engine.metrics.registry)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; False while requests hold blocks (unless reset too)."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Record the engine's steps with torch.profiler (into MINIVLLM_TORCH_PROFILER_DIR or vLLM's
        VLLM_TORCH_PROFILER_DIR); stop_profile() writes the trace."""
        self._profiler.start(profile_prefix)

    def stop_profile(self) -> Path:
        """Stop recording; returns the Chrome-trace JSON file written."""
        return self._profiler.stop()

    def _speed(self, before: dict, t0: float) -> str:
        now, dt = self.engine.counters.as_dict(), max(time.perf_counter() - t0, 1e-9)
        prefill = now["num_prefill_tokens_computed"] - before["num_prefill_tokens_computed"]
        decode = now["num_generated_tokens"] - before["num_generated_tokens"]
        return f"prefill {prefill / dt:.0f} tok/s, decode {decode / dt:.0f} tok/s"


def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict or a list of token ids) or a list of them, as a list."""
    single = not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int))
    return [prompts] if single else list(prompts)
