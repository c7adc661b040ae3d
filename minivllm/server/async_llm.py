"""AsyncLLM: the server's asyncio engine (server/async_engine.py) under vLLM's name and API.

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for out in engine.generate(prompt, SamplingParams(...), request_id="r1"):
        print(out.outputs[0].text)
    engine.shutdown()

Concurrent `generate()` calls join one running batch, as the server's do; the owner task starts on
the event loop of the first call. With RequestOutputKind.DELTA the engine still makes cumulative
outputs (the owner keeps only the newest one per request) and the deltas are cut here, so a slow
reader gets one larger delta, never a gap (vLLM merges pending deltas the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.server.async_engine import AsyncEngine, RequestStream
from minivllm.server.engine_thread import EngineThread
from minivllm.tokenizer import Tokenizer


class AsyncLLM:
    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None) -> None:
        """`thread`: the EngineThread that built `engine`, to step it (the classmethods build it
        there)."""
        self.engine = engine
        self._thread = thread
        # prompts are tokenized on the event loop while the engine detokenizes in its worker thread;
        # a Hugging Face tokenizer must not be used by two threads at once, so this one is our own
        tok = None if engine.tokenizer is None else Tokenizer(engine.config.tokenizer)
        src = engine.input_processor
        self.input_processor = InputProcessor(engine.config, tok, src.eos_token_ids,
                                              src.num_kv_blocks, src.structured)
        self._core: AsyncEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._stopping: asyncio.Task | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, **_: Any) -> AsyncLLM:
        """From an EngineConfig (minivllm.config.VllmConfig is the same class)."""
        thread = EngineThread()
        return cls(thread.build(LLMEngine, vllm_config), thread)

    @classmethod
    def from_engine_args(cls, engine_args: Any, **_: Any) -> AsyncLLM:
        """From vLLM's AsyncEngineArgs / EngineArgs (minivllm.engine.arg_utils). vLLM's other
        keyword arguments (usage_context, stat loggers) are accepted and ignored."""
        return cls.from_vllm_config(engine_args.create_engine_config())

    # ---- state -----------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._core is not None and self._core.error is None

    @property
    def errored(self) -> bool:
        return self._core is not None and self._core.error is not None

    async def get_tokenizer(self):
        """The Hugging Face tokenizer (awaitable, as in vLLM)."""
        return None if self.engine.tokenizer is None else self.engine.tokenizer.hf

    def _started(self) -> AsyncEngine:
        loop = asyncio.get_running_loop()
        if self._core is None:
            if self._loop is not None:
                raise ValueError("this AsyncLLM has been shut down")
            self._core, self._loop = AsyncEngine(self.engine, thread=self._thread), loop
            self._core.start()
        elif loop is not self._loop:
            raise ValueError("an AsyncLLM serves the event loop it first ran on; create one per "
                             "loop")
        return self._core

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       **_: Any) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs: every step's (CUMULATIVE, DELTA) or only the last
        (FINAL_ONLY). Leaving the loop early aborts the request."""
        core = self._started()
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        if request_id is None:
            raise ValueError("generate() needs a request_id (vLLM's AsyncLLM does too)")
        delta = params.output_kind is RequestOutputKind.DELTA
        if delta:
            params = replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        request = self.input_processor.process(request_id, prompt, params, None, priority)
        stream = await core.generate([request])
        self._streams[request_id] = stream
        sent: dict[int, tuple[int, int]] = {}  # completion index -> (chars, tokens) already given
        try:
            async for outs in stream:
                for out in outs:
                    yield cut_delta(out, sent) if delta else out
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:  # the caller stopped reading: stop the work too
                core.abort(stream)

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests: their generate() loops end with the outputs so far. Unknown ids: no-op."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            stream = self._streams.get(rid)
            if stream is not None and self._core is not None:
                self._core.abort(stream)
                stream._abort()

    def shutdown(self) -> None:
        """Abort everything in flight and stop the owner task (from inside or outside its loop)."""
        core, self._core = self._core, None
        if core is None:
            return
        core.abort_all()
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop:  # inside the loop: it ends once we yield
                self._stopping = self._loop.create_task(core.stop())
                return
        if self._loop.is_closed():
            return
        if self._loop.is_running():  # another thread's loop
            asyncio.run_coroutine_threadsafe(core.stop(), self._loop).result(timeout=30)
        else:
            self._loop.run_until_complete(core.stop())


def cut_delta(out: RequestOutput, sent: dict[int, tuple[int, int]]) -> RequestOutput:
    """A cumulative output minus what this reader was already given (updates `sent`)."""
    completions = []
    for c in out.outputs:
        chars, tokens = sent.get(c.index, (0, 0))
        sent[c.index] = (len(c.text), len(c.token_ids))
        completions.append(CompletionOutput(c.index, c.text[chars:], c.token_ids[tokens:],
                                            c.finish_reason, c.stop_reason,
                                            None if c.logprobs is None else c.logprobs[tokens:],
                                            c.cumulative_logprob))
    return replace(out, outputs=completions)
