"""OpenAI completions and chat requests in, engine requests out; engine outputs in, OpenAI out.

One HTTP call becomes one engine request per prompt (each with n sequences); choice i * n + j is
sequence j of prompt i, as in OpenAI's API. Streams send text deltas of the cumulative outputs. A
whole response (up to 100,000 choices) is JSON-encoded in the preprocess pool as its outputs finish,
so the event loop never spends more than a step's worth of work on one. A client's X-Request-Id
names the call, but its engine ids get a fresh suffix, so two calls may send the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from minivllm.core.sequence import FinishReason
from minivllm.engine.llm_engine import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from minivllm.server.limits import ServerLimits
from minivllm.server.logprobs_format import chat_logprobs, completion_logprobs
from minivllm.server.preprocess import Preprocessor
from minivllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    engine_error,
    finish_reason,
    usage,
)
from minivllm.server.request_log import RequestLog

T = TypeVar("T")
RESPONSE_OUTPUTS_PER_JOB = 512  # engine outputs (prompts) per response-building job


class SSEResponse(StreamingResponse):
    """Always closes its generator: an abandoned stream aborts its requests now, not at GC."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Call:
    """One HTTP call in flight: what its chunks need to say and how far each choice was sent."""

    id: str
    object: str
    model: str
    request_ids: list[str]
    params: SamplingParams
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (vLLM's stream_options.continuous_usage_stats)
    top_logprobs: int | None  # None: no logprobs; k: each token's logprob and the top k
    echo: bool  # completions: the prompt (and its logprobs) before the completion
    prefix_len: dict[int, int] = field(default_factory=dict)  # choice -> chars of echoed prompt
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, int] = field(default_factory=dict)  # choice index -> characters sent
    sent_tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens in chunks sent
    done: set[int] = field(default_factory=set)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    prompt_index: dict[str, int] = field(init=False)  # engine request id -> its prompt's position

    def __post_init__(self) -> None:
        self.prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}

    @property
    def num_choices(self) -> int:
        return len(self.request_ids) * self.params.n

    def choice_index(self, out: RequestOutput, j: int) -> int:
        return self.prompt_index[out.request_id] * self.params.n + j

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))

    def chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        if self.include_usage and "usage" not in body:
            body["usage"] = self.usage() if self.continuous_usage and choices else None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


@dataclass
class OpenAIServing:
    engine: AsyncEngine
    model_name: str
    pre: Preprocessor
    limits: ServerLimits
    request_log: RequestLog

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}",
                           param="model", code="model_not_found", status=404)

    def check_limits(self, params: SamplingParams, num_prompts: int) -> None:
        """n and the output tokens per call are capped, so one request cannot hold the engine."""
        if params.n > self.limits.max_n:
            raise APIError(f"n is {params.n}; this server allows at most {self.limits.max_n}",
                           param="n")
        per_seq = params.max_tokens or self.pre.max_model_len
        total = per_seq * params.n * num_prompts
        if total > self.limits.max_tokens_times_n:
            raise APIError(f"max_tokens x n x prompts = {per_seq} x {params.n} x {num_prompts} = "
                           f"{total} output tokens; this server allows at most "
                           f"{self.limits.max_tokens_times_n} per request",
                           param="max_tokens" if params.n == 1 else "n")

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        req.check_supported()
        params = req.sampling_params(default_max_tokens=16)
        return await self._serve(req, raw, "cmpl", "text_completion", req.prompts(), params,
                                 arrival)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        req.check_supported()
        params = req.sampling_params(default_max_tokens=None)  # as OpenAI: up to the context window
        for name in ("max_tokens", "max_completion_tokens"):  # both checked, though one is used
            value = getattr(req, name)
            if value is not None and not 1 <= value < self.pre.max_model_len:
                raise APIError(f"{name} is {value}; it must be >= 1 and leave room for the prompt "
                               f"in this model's maximum context length of "
                               f"{self.pre.max_model_len} tokens", param=name)
        if not self.pre.has_tokenizer:
            raise APIError("this model has no tokenizer, so it has no chat template",
                           param="messages")
        conversation = req.conversation()
        self.check_limits(params, 1)
        try:
            prompt = await unless_disconnected(raw, self.pre.chat_prompt(conversation))
        except ValueError as e:
            raise engine_error(e, "messages") from e
        if prompt is None:
            return Response(status_code=499)
        return await self._serve(req, raw, "chatcmpl", "chat.completion", [prompt], params, arrival)

    async def _serve(self, req: SamplingRequest, raw: Request, prefix: str, obj: str,
                     prompts: list[PromptType], params: SamplingParams, arrival: float) -> Response:
        self.check_limits(params, len(prompts))
        request_id: str = raw.state.request_id
        base = f"{prefix}-{request_id}"
        # a client's X-Request-Id may name two calls: their engine ids then get a fresh suffix
        named = raw.headers.get("x-request-id") == request_id
        engine_base = f"{base}-{uuid.uuid4().hex[:12]}" if named else base
        ids = [f"{engine_base}-{i}" for i in range(len(prompts))]
        is_chat = obj == "chat.completion"
        self.request_log.received(request_id, ids, arrival, endpoint=raw.url.path,
                                  prompts=len(prompts), n=params.n,
                                  max_tokens=params.max_tokens, stream=bool(req.stream))

        async def admit() -> RequestStream:
            strict = req.requested_max_tokens() is not None
            requests = await self.pre.requests(list(zip(ids, prompts)), params, arrival, strict,
                                               priority=req.priority)
            return await self.engine.generate(requests)

        try:
            stream = await unless_disconnected(raw, admit())
        except (ValueError, EngineDeadError) as e:
            err = dead(e) if isinstance(e, EngineDeadError) else engine_error(
                e, "messages" if is_chat else "prompt")
            self.request_log.rejected(request_id, ids, err.status, err.message)
            raise err from e
        if stream is None:  # the client hung up while its prompts were checked: nothing went in
            self.request_log.rejected(request_id, ids, 499, "the client disconnected")
            return Response(status_code=499)
        call = _Call(base, obj + (".chunk" if is_chat and req.stream else ""), self.model_name, ids,
                     params, req.include_usage, req.continuous_usage, params.logprobs,
                     bool(getattr(req, "echo", False)))
        if req.stream:
            return SSEResponse(self._sse(call, stream, is_chat), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        try:
            body = await self._collect(call, stream, raw, is_chat)
        except EngineDeadError as e:
            raise dead(e) from e
        if body is None:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        return Response(body, media_type="application/json")

    # ---- streaming -------------------------------------------------------------------------------
    async def _sse(self, call: _Call, stream: RequestStream, is_chat: bool) -> AsyncIterator[str]:
        try:
            if is_chat:
                for i in range(call.num_choices):
                    yield call.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}])
            async for outs in stream:
                for out in outs:
                    call.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                    for c in out.outputs:
                        chunk = await self._choice_chunk(call, out, c, is_chat)
                        if chunk is not None:
                            yield chunk
            if stream.aborted:  # the server is shutting down: say so to every choice still open
                empty = {"delta": {}} if is_chat else {"text": ""}
                for i in range(call.num_choices):
                    if i not in call.done:
                        yield call.chunk([{"index": i, **empty, "logprobs": None,
                                           "finish_reason": FinishReason.ABORT.value}])
            if call.include_usage:
                yield call.chunk([], usage=call.usage())
        except EngineDeadError as e:
            yield f"data: {dead(e).body().decode()}\n\n"
        finally:
            self.engine.abort(stream)  # a no-op once everything finished; otherwise the client left
        yield "data: [DONE]\n\n"

    async def _choice_chunk(self, call: _Call, out: RequestOutput, c, is_chat: bool) -> str | None:
        """One choice's SSE chunk for what this step added to it (None: nothing new to send)."""
        i = call.choice_index(out, c.index)
        call.completion_tokens[i] = len(c.token_ids)
        if i in call.done:
            return None
        sent, sent_tokens = call.sent.get(i, 0), call.sent_tokens.get(i, 0)
        delta = c.text[sent:]  # the engine holds back text that may start a stop string
        # one chunk per step with new tokens, even when their text is held back
        if not delta and not c.finished and len(c.token_ids) == sent_tokens:
            return None
        prefix = ""
        if call.echo and i not in call.sent:  # an echoing choice's first chunk: the prompt as sent
            prefix = out.prompt
            if prefix is None:  # or its ids decoded
                prefix = await self.pre.detokenize(out.prompt_token_ids)
            call.prefix_len[i] = len(prefix)
        call.sent[i] = len(c.text)
        call.sent_tokens[i] = len(c.token_ids)
        if c.finished:
            call.done.add(i)
        if is_chat:
            choice = {"index": i, "delta": {"content": delta} if delta or not c.finished else {}}
        else:
            choice = {"index": i, "text": prefix + delta}
        # text_offset: where this chunk's first token starts in the choice's whole text
        logprobs = self._logprobs(call, out, c, sent_tokens, is_chat, echo=bool(prefix),
                                  offset=0 if prefix else call.prefix_len.get(i, 0) + sent)
        return call.chunk([{**choice, "logprobs": logprobs,
                            "finish_reason": finish_reason(c.finish_reason)}])

    # ---- one response ----------------------------------------------------------------------------
    async def _collect(self, call: _Call, stream: RequestStream, raw: Request,
                       is_chat: bool) -> bytes | None:
        """The response as JSON bytes (None: the client left, its requests aborted); each output
        becomes JSON text in the pool as it finishes, so 100,000 of them are never all held."""
        fragments: dict[int, str] = {}  # prompt index -> its choices as JSON text
        totals = [0, 0]  # prompt and completion tokens

        async def render(outs: list[RequestOutput]) -> None:
            for start in range(0, len(outs), RESPONSE_OUTPUTS_PER_JOB):
                batch = outs[start : start + RESPONSE_OUTPUTS_PER_JOB]
                job = functools.partial(self._choices_json, call=call, outs=batch, is_chat=is_chat)
                texts, p, c = await self.pre.run(job)
                for out, text in zip(batch, texts):
                    fragments[call.prompt_index[out.request_id]] = text
                totals[0] += p
                totals[1] += c

        async def drain() -> bytes:
            unfinished: dict[str, RequestOutput] = {}
            async for outs in stream:
                done = []
                for out in outs:
                    if out.finished:
                        unfinished.pop(out.request_id, None)
                        done.append(out)
                    else:
                        unfinished[out.request_id] = out
                await render(done)
            await render(list(unfinished.values()))  # the server aborted these (shutdown)
            head = json.dumps({"id": call.id, "object": call.object, "created": call.created,
                               "model": call.model}, ensure_ascii=False)
            choices = ",".join(fragments[k] for k in sorted(fragments))
            tail = json.dumps(usage(*totals))
            return f'{head[:-1]},"choices":[{choices}],"usage":{tail}}}'.encode()

        body = None
        try:
            body = await unless_disconnected(raw, drain())  # re-raises an engine failure
        finally:
            if body is None:
                self.engine.abort(stream)
        return body

    def _choices_json(self, proc, call: _Call, outs: list[RequestOutput],
                      is_chat: bool) -> tuple[list[str], int, int]:
        """In a pool thread: each output's choices as JSON text (no brackets); the token counts."""
        texts, prompt_tokens, completion_tokens = [], 0, 0
        for out in outs:
            prompt_tokens += len(out.prompt_token_ids)
            prefix = ""
            if call.echo:
                prefix = (out.prompt if out.prompt is not None
                          else proc.tokenizer.decode(out.prompt_token_ids))
            choices = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                body = ({"message": {"role": "assistant",
                                     "content": c.text}} if is_chat else {"text": prefix + c.text})
                # unfinished: the server aborted it
                reason = finish_reason(c.finish_reason) if c.finished else FinishReason.ABORT.value
                logprobs = self._logprobs(call, out, c, 0, is_chat, echo=call.echo)
                choices.append({"index": call.choice_index(out, c.index), **body,
                                "logprobs": logprobs, "finish_reason": reason})
            texts.append(json.dumps(choices, ensure_ascii=False)[1:-1])
        return texts, prompt_tokens, completion_tokens

    @staticmethod
    def _logprobs(call: _Call, out: RequestOutput, c, start: int, is_chat: bool, echo: bool = False,
                  offset: int = 0) -> dict | None:
        """A choice's logprobs from token `start`, OpenAI's format (echo: the prompt's first)."""
        if call.top_logprobs is None or c.logprobs is None:
            return None
        tokens, positions = c.token_ids[start:], c.logprobs[start:]
        if is_chat:
            return chat_logprobs(tokens, positions, call.top_logprobs)
        if echo and out.prompt_logprobs is not None:
            tokens, positions = out.prompt_token_ids + tokens, out.prompt_logprobs + positions
        return completion_logprobs(tokens, positions, call.top_logprobs, offset)


def dead(e: EngineDeadError) -> APIError:
    return APIError(str(e), status=503, type="server_error", code="engine_dead")


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """`await work`, or None if the client hangs up first (then `work` is cancelled)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
