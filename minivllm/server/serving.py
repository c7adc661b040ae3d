"""Turn an OpenAI completions or chat request into engine requests, and their outputs into OpenAI responses.

One HTTP call becomes one engine request per prompt (each with n sequences); choice i * n + j is sequence j
of prompt i, as in OpenAI's API. Streams send text deltas, computed from the engine's cumulative outputs.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDeadError, PromptSource, RequestStream
from minivllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    engine_error,
    finish_reason,
    usage,
)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so an abandoned stream aborts its requests at once
    (rather than whenever the generator happens to be garbage-collected)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class _Call:
    """One HTTP call in flight: what its chunks need to say and how far each choice has been sent."""

    id: str
    object: str
    model: str
    request_ids: list[str]
    params: SamplingParams
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, int] = field(default_factory=dict)  # choice index -> characters sent
    sent_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens covered by chunks sent
    done: set[int] = field(default_factory=set)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return len(self.request_ids) * self.params.n

    def choice_index(self, out: RequestOutput, j: int) -> int:
        return self.request_ids.index(out.request_id) * self.params.n + j

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))

    def chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        if self.include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def check_model(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req)
        req.check_supported()
        params = req.sampling_params(default_max_tokens=16)
        return await self._serve(req, raw, "cmpl", "text_completion", req.prompts(), params, arrival)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req)
        req.check_supported()
        params = req.sampling_params(default_max_tokens=None)  # as OpenAI: up to the context window
        tokenizer = self.engine.engine.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer, so it has no chat template", param="messages")
        conversation = req.conversation()

        def prompt() -> dict:  # runs in the engine's owner thread, next to every other tokenizer call
            try:
                text, ids = tokenizer.apply_chat_template(conversation)
                return {"prompt": text, "prompt_token_ids": ids}
            except (ValueError, TypeError, jinja2.TemplateError) as e:  # no template, or the messages do not fit it
                raise ValueError(f"chat template failed: {e}") from e

        return await self._serve(req, raw, "chatcmpl", "chat.completion", [prompt], params, arrival)

    async def _serve(self, req: SamplingRequest, raw: Request, prefix: str, obj: str, prompts: list[PromptSource],
                     params: SamplingParams, arrival: float) -> Response:
        base = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        try:
            stream = await self.engine.generate(list(zip(ids, prompts)), params, arrival, req.priority)
        except ValueError as e:
            raise engine_error(e) from e
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="server_error", code="engine_dead") from e
        is_chat = obj == "chat.completion"
        call = _Call(base, obj + (".chunk" if is_chat and req.stream else ""), self.model_name, ids, params,
                     req.include_usage)
        if req.stream:
            return SSEResponse(self._sse(call, stream, is_chat), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        try:
            final = await self._collect(stream, raw)
        except EngineDeadError as e:
            raise APIError(str(e), status=503, type="server_error", code="engine_dead") from e
        if final is None:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        return JSONResponse(self._response(call, final, is_chat))

    # ---- streaming ---------------------------------------------------------------------------------
    async def _sse(self, call: _Call, stream: RequestStream, is_chat: bool) -> AsyncIterator[str]:
        try:
            if is_chat:
                for i in range(call.num_choices):
                    yield call.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}])
            async for outs in stream:
                for out in outs:
                    call.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                    for c in out.outputs:
                        i = call.choice_index(out, c.index)
                        call.completion_tokens[i] = len(c.token_ids)
                        if i in call.done:
                            continue
                        sent = call.sent.get(i, 0)
                        delta = c.text[sent:]  # the engine holds back text that may start a stop string
                        if not delta and not c.finished and len(c.token_ids) == call.sent_tokens.get(i, 0):
                            continue  # one chunk per step with new tokens, even when their text is held back
                        call.sent[i] = len(c.text)
                        call.sent_tokens[i] = len(c.token_ids)
                        if c.finished:
                            call.done.add(i)
                        reason = finish_reason(c.finish_reason)
                        if is_chat:
                            choice = {"index": i, "delta": {"content": delta} if delta or not c.finished else {}}
                        else:
                            choice = {"index": i, "text": delta}
                        yield call.chunk([{**choice, "logprobs": None, "finish_reason": reason}])
            if call.include_usage:
                yield call.chunk([], usage=call.usage())
        except EngineDeadError as e:
            yield f"data: {json.dumps(APIError(str(e), status=503, type='server_error').body())}\n\n"
        finally:
            self.engine.abort(stream)  # a no-op once everything finished; otherwise the client left
        yield "data: [DONE]\n\n"

    # ---- one response --------------------------------------------------------------------------------
    async def _collect(self, stream: RequestStream, raw: Request) -> dict[str, RequestOutput] | None:
        """The final outputs, or None if the client disconnected first (then its requests are aborted)."""
        final: dict[str, RequestOutput] = {}

        async def drain() -> None:
            async for outs in stream:
                final.update({o.request_id: o for o in outs})

        async def disconnected() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.engine.abort(stream)
        if not work.done() or work.cancelled():
            return None
        work.result()  # re-raise an engine failure
        return final

    def _response(self, call: _Call, final: dict[str, RequestOutput], is_chat: bool) -> dict:
        choices = []
        for out in final.values():
            call.prompt_tokens[out.request_id] = len(out.prompt_token_ids)
            for c in out.outputs:
                i = call.choice_index(out, c.index)
                call.completion_tokens[i] = len(c.token_ids)
                body = {"message": {"role": "assistant", "content": c.text}} if is_chat else {"text": c.text}
                choices.append({"index": i, **body, "logprobs": None, "finish_reason": finish_reason(c.finish_reason)})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": call.id, "object": call.object, "created": call.created, "model": call.model,
                "choices": choices, "usage": call.usage()}
