"""OutputProcessor: token ids from the scheduler become text and RequestOutputs for the caller.

It keeps its own state per sequence (token ids, text, the incremental detokenizer) and per user
request (its n sequences), fed only by the plain `EngineCoreOutput`s each step produces. It owns all
that needs text: incremental detokenization, stop strings (the scheduler deals in ids), holding back
text that may still become a stop string, and assembling the outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from minivllm.core.sequence import FinishReason
from minivllm.core.step_io import EngineCoreOutput, TokenLogprobs
from minivllm.engine.input_processor import EngineRequest
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.tokenizer import DetokenizerState, Tokenizer, find_stop_string


@dataclass
class SequenceText:
    """One sequence as the caller will see it."""

    index: int
    token_ids: list[int]  # prompt + output, as far as this processor has seen
    num_prompt_tokens: int
    detokenizer: DetokenizerState | None
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    core: EngineCoreOutput | None = None  # the scheduler's latest counters (cache hits, drafts)
    # output tokens and characters already reported (RequestOutputKind.DELTA)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_silent_tokens: int = 0  # 1 when the last token stopped the sequence and adds no text
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, when asked
    cumulative_logprob: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:  # without copying them, as output_token_ids does
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class RequestGroup:
    """One user request and its n sequences."""

    request: EngineRequest
    sequences: dict[str, SequenceText] = field(default_factory=dict)  # by scheduler request id
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # its first sequence's, if asked

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


def streams_text(params: SamplingParams) -> bool:
    """Text is built token by token only if someone reads it before the end: a stream, or stop
    strings. Otherwise (FINAL_ONLY, as in LLM.generate) it is decoded once when the request ends:
    per-token detokenization took about 11 us a token on the 2-core test machine (2.8 ms a step at a
    batch of 256)."""
    return params.detokenize and (params.output_kind is not RequestOutputKind.FINAL_ONLY
                                  or bool(params.stop_strings))


def visible_text(seq: SequenceText, params: SamplingParams) -> str:
    """The text so far, minus a tail that might still turn out to start a stop string. A stop
    string is cut from the output when it completes, so without this hold-back a stream could
    already have shown its first characters. Held back, the text a caller sees only ever grows."""
    if seq.finish_reason is not None or not params.stop_strings:
        return seq.text
    hold = max(len(s) for s in params.stop_strings) - 1
    return seq.text[: max(len(seq.text) - hold, 0)]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}  # user request id -> its group
        self.parent_of: dict[str, str] = {}  # scheduler request id -> user request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add_request(self, request: EngineRequest) -> None:
        params = request.params
        group = self.groups[request.request_id] = RequestGroup(request)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first prompt token has nothing before it
        for seq in request.sequences:
            detok = self.tokenizer.start_detokenizer(
                len(seq.prompt_token_ids), params.skip_special_tokens,
                params.spaces_between_special_tokens) if self.tokenizer else None
            group.sequences[seq.request_id] = SequenceText(
                seq.index, list(seq.prompt_token_ids), len(seq.prompt_token_ids), detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None or params.ranks_by_logprob
                else None)
            self.parent_of[seq.request_id] = request.request_id

    def _append_tokens(self, seq: SequenceText, core: EngineCoreOutput, params: SamplingParams,
                       eos_token_ids) -> str | None:
        """Append one step's tokens, text and logprobs as far as they are kept; any stop string."""
        num_before, hit = seq.num_output_tokens, None
        # a stop token's text (EOS, stop_token_ids) is left out, as a stop string is, unless asked
        last = core.new_token_ids[-1]
        silent_last = (core.finish_reason is FinishReason.STOP
                       and not params.include_stop_str_in_output and
                       (last == core.stop_reason or last in eos_token_ids))
        for i, token in enumerate(core.new_token_ids):
            seq.token_ids.append(token)
            if silent_last and i == len(core.new_token_ids) - 1:
                seq.num_silent_tokens = 1
                break
            hit = self._stream_text(seq, params)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, hit
                break
        if seq.cumulative_logprob is not None and core.logprobs is not None:
            kept = core.logprobs[: seq.num_output_tokens - num_before]  # the tokens kept
            if seq.logprobs is not None:
                seq.logprobs += [self._logprob_dict(p, params) for p in kept]
            seq.cumulative_logprob += sum(p.logprobs[0] for p in kept)
        return hit

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput],
                                                                     dict[str, str]]:
        """Turn one step's new tokens into outputs; also {sequence id: stop string} for the
        sequences a stop string ended, which the scheduler must now finish (it reads no text)."""
        now = time.monotonic()
        touched: dict[str, RequestGroup] = {}
        stopped: dict[str, str] = {}
        for core in core_outputs:
            group = self.groups[self.parent_of[core.request_id]]
            seq, params = group.sequences[core.request_id], group.request.params
            seq.core = core
            if core.prompt_logprobs and seq.index == 0:
                group.prompt_logprobs += [self._logprob_dict(p, params)
                                          for p in core.prompt_logprobs]
            if not core.new_token_ids:  # a prompt chunk that only brought prompt logprobs
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            hit = self._append_tokens(seq, core, params, group.request.sequences[0].eos_token_ids)
            if hit is not None:
                stopped[core.request_id] = hit
            if seq.finish_reason is None and core.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = core.finish_reason, core.stop_reason
            if seq.finish_reason is not None:
                self._finish_text(seq, params, now)
            touched[group.request.request_id] = group
        outputs = [self._output(g) for g in touched.values() if g.finished or not (
                   g.request.params.output_kind is RequestOutputKind.FINAL_ONLY
                   or g.request.params.ranks_by_logprob)]
        return outputs, stopped

    def abort(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """End a user request: its unfinished sequence ids (to abort) and its final output."""
        group = self.groups.get(request_id)
        if group is None:
            return [], None
        now, ids = time.monotonic(), []
        for rid, seq in group.sequences.items():
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ABORT
                self._finish_text(seq, group.request.params, now)
                ids.append(rid)
        return ids, self._output(group)

    def _logprob_dict(self, position: TokenLogprobs, params: SamplingParams) -> dict[int, Logprob]:
        """vLLM's shape: token id -> Logprob, the token at the position first, then the top k."""
        text = (self.tokenizer.token_text if self.tokenizer is not None and params.detokenize
                else lambda _: None)
        out: dict[int, Logprob] = {}
        for t, lp, rank in zip(position.token_ids, position.logprobs, position.ranks):
            if t not in out:  # the chosen token may be among the top k too
                out[t] = Logprob(lp, rank, text(t))
        return out

    def _stream_text(self, seq: SequenceText, params: SamplingParams) -> str | None:
        """Extend the text by the newest token (if this request streams it); the stop string it
        completed, if any."""
        if self.tokenizer is None or not streams_text(params):
            return None
        before = len(seq.text)
        seq.text += self.tokenizer.detokenize_step(seq.token_ids, seq.detokenizer)
        hit = find_stop_string(seq.text, len(seq.text) - before, params.stop_strings)
        if hit is None:
            return None
        start, stop = hit
        seq.text = seq.text[: start + len(stop) if params.include_stop_str_in_output else start]
        return stop

    def _finish_text(self, seq: SequenceText, params: SamplingParams, now: float) -> None:
        """A sequence that did not stream its text gets all of it now, in one decode."""
        seq.finish_time = now
        if self.tokenizer is not None and params.detokenize and not streams_text(params):
            end = len(seq.token_ids) - seq.num_silent_tokens
            seq.text += self.tokenizer.detokenize_rest(seq.token_ids[:end], seq.detokenizer)

    def _output(self, group: RequestGroup) -> RequestOutput:
        req, seqs = group.request, list(group.sequences.values())
        shown = seqs
        # best_of: the n likeliest, best first, numbered 0..n-1 (vLLM V0's order)
        if req.params.ranks_by_logprob:
            shown = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: req.params.n]
            shown = [replace(s, index=i) for i, s in enumerate(shown)]
        delta = req.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for s in shown:
            text, tokens, logprobs = visible_text(s, req.params), s.output_token_ids, s.logprobs
            if delta:  # only what the caller has not seen yet
                logprobs = None if logprobs is None else logprobs[s.num_sent_tokens :]
                text, tokens, s.num_sent_chars, s.num_sent_tokens = (
                    text[s.num_sent_chars :], tokens[s.num_sent_tokens :], len(text), len(tokens))
            # vLLM's outputs carry plain strings
            reason = None if s.finish_reason is None else s.finish_reason.value
            completions.append(CompletionOutput(s.index, text, list(tokens), reason, s.stop_reason,
                                                None if logprobs is None else list(logprobs),
                                                s.cumulative_logprob))
        cores = [s.core for s in seqs if s.core is not None]
        times = [s.first_token_time for s in seqs if s.first_token_time is not None]
        scheduled = [c.first_scheduled_time for c in cores if c.first_scheduled_time is not None]
        metrics = RequestMetrics(req.arrival_time, first_scheduled_time=min(scheduled) if scheduled
                                 else None, first_token_time=min(times) if times else None,
                                 finished_time=max((s.finish_time or 0) for s in seqs) or None,
                                 spec_num_proposed=sum(c.num_spec_proposed for c in cores),
                                 spec_num_accepted=sum(c.num_spec_accepted for c in cores))
        finished = group.finished
        if finished:
            del self.groups[req.request_id]
            for rid in group.sequences:
                self.parent_of.pop(rid, None)
        # the n samples' best prefix-cache hit (the first computes what the others reuse)
        num_cached = max((c.num_cached_tokens for c in cores), default=0)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished, num_cached, metrics, sum(c.num_preemptions for c in cores),
                             prompt_logprobs=group.prompt_logprobs)
