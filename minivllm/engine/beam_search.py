"""Beam search on copy-on-write blocks: `LLM.beam_search(prompts, BeamSearchParams(...))`.

Every beam is a scheduler sequence whose next token the search picks itself (`external_sampling`);
each round steps the engine until every live beam's last token is computed and reads its logprobs.
The beam_width best candidates (vLLM's score) become *forks* (`Scheduler.fork`): new requests that
share their parent's blocks by reference count, so a fork costs at most one copy-on-write block copy
instead of a copy of the whole table (`stats()`: `num_forked_blocks`, `num_cow_copies`). vLLM V1
shares beams' prefixes through prefix caching instead; forking makes the sharing explicit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minivllm.core.sequence import FinishReason, Sequence, SequenceStatus
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine, PromptType


@dataclass
class BeamSearchParams:
    """vLLM's. `temperature` > 0 divides the logits before the log-softmax; 0 uses them as is."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM returns it: `tokens` (prompt + generated) and their `text`."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token: id -> logprob
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: FinishReason | None = None  # STOP (EOS) or LENGTH
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative logprob / length ** length_penalty, the length counting the prompt
    and not a final EOS. (transformers divides by the generated length only: beams of equal length
    rank the same.)"""
    seq_len = len(tokens) - (eos_token_id is not None and tokens[-1] == eos_token_id)
    return cumulative_logprob / (seq_len**length_penalty)


@dataclass
class _Instance:  # one prompt's search: live beams (each with its request) and finished ones

    beams: list[tuple[Sequence, BeamSearchSequence]]
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """Runs beam searches on an engine with no other requests in flight: it drives the scheduler."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def _add_requests(self, prompts: list[PromptType], params: BeamSearchParams) -> list[_Instance]:
        """One engine request per prompt, its first beam: the engine computes, the search picks."""
        eng = self.engine
        # the requests only carry tokens and blocks: the search decides every token and stop itself
        plain = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        instances = []
        for prompt in prompts:
            request = eng.process_request(f"beam-{next(self._ids)}", prompt, plain).sequences[0]
            request.external_sampling = True  # the engine computes its logits, the search picks
            eng.scheduler.add(request)
            first = BeamSearchSequence(list(request.prompt_token_ids))
            instances.append(_Instance([(request, first)]))
        return instances

    def _extend(self, inst: _Instance, logprobs: dict[str, torch.Tensor], k: int, stops: set[int],
                score) -> None:
        """One search step of one prompt: every beam's 2k best tokens, the k best kept as forks."""
        eng = self.engine
        candidates = []
        for request, seq in inst.beams:
            top = logprobs[request.request_id].topk(2 * k)
            step = dict(zip(top.indices.tolist(), top.values.tolist()))
            for token, lp in step.items():
                new = BeamSearchSequence(seq.tokens + [token], seq.logprobs + [step],
                                         seq.cum_logprob + lp)
                if token in stops:
                    new.finish_reason = FinishReason.STOP
                    inst.completed.append(new)
                else:
                    candidates.append((new, request, token))
        chosen = sorted(candidates, key=lambda c: score(c[0]), reverse=True)[:k]
        parents = [request for request, _ in inst.beams]
        inst.beams = [(eng.scheduler.fork(parent, f"{parent.parent_id}.{next(self._ids)}", token),
                       new) for new, parent, token in chosen]
        # forks hold on
        eng.scheduler.finish_requests([p.request_id for p in parents], FinishReason.ABORT)

    def run(self, prompts: list[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        eng, k = self.engine, params.beam_width
        if eng.has_unfinished_requests():
            raise ValueError("beam_search needs an idle engine: finish or abort the other requests "
                             "first")
        eos = None if params.ignore_eos else eng.eos_token_id
        stops = set() if params.ignore_eos else set(eng.eos_token_ids)
        instances = self._add_requests(prompts, params)

        def score(seq: BeamSearchSequence) -> float:
            return get_beam_search_score(seq.tokens, seq.cum_logprob, eos, params.length_penalty)

        try:
            for _ in range(params.max_tokens):
                live = [request for inst in instances for request, _ in inst.beams]
                if not live:
                    break
                logprobs = self._logprobs(live, params.temperature)
                for inst in instances:
                    self._extend(inst, logprobs, k, stops, score)
        finally:
            ids = [r.request_id for inst in instances for r, _ in inst.beams]
            eng.scheduler.finish_requests(ids, FinishReason.ABORT)
            eng.core_step()  # the runner forgets the finished beams now
        outputs = []
        for inst in instances:
            for _, seq in inst.beams:
                seq.finish_reason = FinishReason.LENGTH
            best = sorted(inst.completed + [seq for _, seq in inst.beams], key=score,
                          reverse=True)[:k]
            for seq in best:
                seq.text = eng.tokenizer.decode(seq.tokens) if eng.tokenizer is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _logprobs(self, live: list[Sequence], temperature: float) -> dict[str, torch.Tensor]:
        """Step the engine until every live beam's last token is computed; its log-softmax. Under
        memory pressure beams that are done give their blocks up, and their forks are computed
        afresh (helped by the prefix cache) rather than sharing blocks."""
        eng, seqs = self.engine, self.engine.scheduler.sequences
        wanted, got = {r.request_id for r in live}, {}
        vocab = eng.config.model_config.vocab_size

        def observe(request_ids: list[str], logits: torch.Tensor) -> None:
            for rid, row in zip(request_ids, logits):
                if rid in wanted:
                    row = row[:vocab].float()
                    got[rid] = torch.log_softmax(row / temperature if temperature > 0 else row,
                                                 -1).cpu()

        eng.runner.logits_observers.append(observe)
        try:
            while wanted - got.keys():
                record = eng.core_step()
                # nothing could run: beams that are done hold the blocks, so let them go
                if record is None:
                    done = [rid for rid in got if rid in seqs]
                    if not done:
                        raise RuntimeError("beam search cannot make progress: the KV cache is too "
                                           "small")
                    eng.scheduler.finish_requests(done, FinishReason.ABORT)
                    continue
                # a beam done but since preempted need not come back: its forks start afresh
                eng.scheduler.finish_requests([r for r in got if r in seqs and seqs[r].status
                                               is not SequenceStatus.RUNNING], FinishReason.ABORT)
                eng.notify(record)
        finally:
            eng.runner.logits_observers.remove(observe)
        return got
