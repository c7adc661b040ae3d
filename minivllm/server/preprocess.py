"""Requests tokenized and checked, large responses built: in a small thread pool, a tokenizer each.

Not on the engine's owner: every running stream would wait for a 10 MB prompt. Not on the event
loop: every connection would. A tokenizer per thread: Hugging Face's are not thread-safe. A call's
prompts go in pieces of `PROMPTS_PER_JOB`, one job after another, so a later client queues behind a
piece, never a whole 100,000-prompt call, and a client that hangs up stops at the next piece.
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


def tokenizer(proc: InputProcessor, why: str = "") -> Tokenizer:
    if proc.tokenizer is None:
        raise ValueError(f"this model has no tokenizer{why}")
    return proc.tokenizer


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
    """`workers` threads and as many InputProcessors, each with its own tokenizer (loaded at
    start-up, not while the first clients wait); a job borrows one for its duration."""

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
        """Every prompt tokenized and checked (ValueError names the first bad one), in pieces.
        `strict_max_tokens`: the client chose max_tokens, so prompt + max_tokens beyond the context
        is an error (as in vLLM), not silently capped."""

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
            try:
                text, ids = tokenizer(proc, ", so it has no chat template").apply_chat_template(
                    conversation, chat_template=self.chat_template,
                    add_generation_prompt=add_generation_prompt)
            except (ValueError, TypeError, jinja2.TemplateError) as e:  # no template, bad messages
                raise ValueError(f"chat template failed: {e}") from e
            return {"prompt": text, "prompt_token_ids": ids}

        return await self.run(job)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_unicode(text, "prompt")

        def job(proc: InputProcessor) -> list[int]:
            return tokenizer(proc).hf(text, add_special_tokens=add_special_tokens).input_ids

        return await self.run(job)

    async def detokenize(self, tokens: list[int]) -> str:
        def job(proc: InputProcessor) -> str:
            tok = tokenizer(proc)
            if bad := [t for t in tokens if not 0 <= t < proc.vocab_size]:
                raise ValueError(f"token ids outside the vocabulary [0, {proc.vocab_size}): "
                                 f"{bad[:5]}")
            return tok.decode(tokens)

        return await self.run(job)
