"""Requests tokenized and checked, large responses built: in a small thread pool, a tokenizer each.

Why not on the engine's owner: a 10 MB prompt takes many seconds to tokenize, and every running
stream would wait for it. Why not on the event loop: it would stall every connection instead. Why a
tokenizer per thread: a Hugging Face tokenizer is not safe to share between threads, and the
engine's own one detokenizes its outputs. The engine only queues requests already checked.

Why work goes in in pieces: a call with 100,000 prompts is checked `PROMPTS_PER_JOB` prompts at a
time, one job after the other, so one call holds at most one of the pool's threads and for at most
one piece; a later client's job queues behind a piece, never behind the whole call, and a client
that hangs up stops its call at the next piece.
"""

from __future__ import annotations

import asyncio
import functools
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import jinja2

from minivllm.engine.input_processor import EngineRequest, InputProcessor
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import StructuredOutputManager
from minivllm.tokenizer import Tokenizer

T = TypeVar("T")
PROMPTS_PER_JOB = 256  # prompts one pool job checks (token-id prompts: ~10 ms of work)
CHARS_PER_JOB = 2**18  # or fewer, when they are long texts to tokenize


def check_unicode(text: str, what: str) -> None:
    """A JSON string may hold a lone surrogate ("\\ud800"), which no tokenizer or UTF-8 accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: it holds a lone surrogate at character "
                         f"{e.start}") from None


def pieces(prompts: list[tuple[str, PromptType]]) -> list[list[tuple[str, PromptType]]]:
    """Runs of <= PROMPTS_PER_JOB prompts, in order, and (past the first) <= CHARS_PER_JOB chars."""
    out: list[list[tuple[str, PromptType]]] = [[]]
    chars = 0
    for item in prompts:
        size = len(item[1]) if isinstance(item[1], str) else 1
        if out[-1] and (len(out[-1]) == PROMPTS_PER_JOB or chars + size > CHARS_PER_JOB):
            out.append([])
            chars = 0
        out[-1].append(item)
        chars += size
    return out


class Preprocessor:
    """`workers` threads and as many InputProcessors, each with its own tokenizer, loaded here (at
    start-up, not while the first burst of clients waits); a job borrows one for its duration."""

    def __init__(self, engine: LLMEngine, workers: int = 4,
                 chat_template: str | None = None) -> None:
        self.config = engine.config
        self.chat_template = chat_template  # --chat-template: replaces the tokenizer's own
        self.max_model_len = engine.config.max_model_len
        self.has_tokenizer = engine.tokenizer is not None
        self._free: queue.SimpleQueue[InputProcessor] = queue.SimpleQueue()
        for _ in range(workers):
            tok = Tokenizer(self.config.tokenizer) if self.has_tokenizer else None
            # grammars are checked here too, before the engine sees them
            structured = None if tok is None else StructuredOutputManager(
                tok.hf, self.config.model_config.vocab_size, engine.eos_token_ids)
            self._free.put(InputProcessor(self.config, tok, engine.eos_token_ids,
                                          engine.runner.num_blocks, structured))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="minivllm-preprocess")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[[InputProcessor], T]) -> T:
        """`fn(processor)` in a pool thread, with an InputProcessor no other thread is using."""

        def job() -> T:
            proc = self._free.get()  # never waits: there are as many processors as threads
            try:
                return fn(proc)
            finally:
                self._free.put(proc)

        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    # ---- the jobs --------------------------------------------------------------------------------
    async def requests(self, prompts: list[tuple[str, PromptType]], params: SamplingParams,
                       arrival: float, strict_max_tokens: bool,
                       priority: int = 0) -> list[EngineRequest]:
        """Every prompt tokenized and checked (ValueError names the first bad one), none queued yet;
        in pieces (see the module's docstring), so cancelling the caller stops at the next piece.

        `strict_max_tokens`: the client chose max_tokens, so prompt + max_tokens beyond the context
        is an error (as in vLLM) rather than silently capped."""

        def job(proc: InputProcessor, piece: list[tuple[str, PromptType]]) -> list[EngineRequest]:
            out = []
            for rid, prompt in piece:
                if isinstance(prompt, str):
                    check_unicode(prompt, "prompt")
                req = proc.process(rid, prompt, params, arrival, priority)
                need = len(req.prompt_token_ids) + (params.max_tokens or 0)
                if strict_max_tokens and need > self.max_model_len:
                    raise ValueError(f"this model's maximum context length is {self.max_model_len} "
                                     f"tokens; the prompt has {len(req.prompt_token_ids)} and "
                                     f"max_tokens asks for {params.max_tokens} more: lower "
                                     f"max_tokens")
                out.append(req)
            return out

        out: list[EngineRequest] = []
        for piece in pieces(prompts):
            out += await self.run(functools.partial(job, piece=piece))
        return out

    async def chat_prompt(self, conversation: list[dict],
                          add_generation_prompt: bool = True) -> dict:
        """The conversation through the chat template: {"prompt": text, "prompt_token_ids": ids}."""
        for m in conversation:
            check_unicode(m["content"], "messages")

        def job(proc: InputProcessor) -> dict:
            if proc.tokenizer is None:
                raise ValueError("this model has no tokenizer, so it has no chat template")
            try:
                text, ids = proc.tokenizer.apply_chat_template(
                    conversation, chat_template=self.chat_template,
                    add_generation_prompt=add_generation_prompt)
            except (ValueError, TypeError, jinja2.TemplateError) as e:  # no template, bad messages
                raise ValueError(f"chat template failed: {e}") from e
            return {"prompt": text, "prompt_token_ids": ids}

        return await self.run(job)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_unicode(text, "prompt")

        def job(proc: InputProcessor) -> list[int]:
            if proc.tokenizer is None:
                raise ValueError("this model has no tokenizer")
            return proc.tokenizer.hf(text, add_special_tokens=add_special_tokens).input_ids

        return await self.run(job)

    async def detokenize(self, tokens: list[int]) -> str:
        def job(proc: InputProcessor) -> str:
            if proc.tokenizer is None:
                raise ValueError("this model has no tokenizer")
            bad = [t for t in tokens if not 0 <= t < proc.vocab_size]
            if bad:
                raise ValueError(f"token ids outside the vocabulary [0, {proc.vocab_size}): "
                                 f"{bad[:5]}")
            return proc.tokenizer.decode(tokens)

        return await self.run(job)
