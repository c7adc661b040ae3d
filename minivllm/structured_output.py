"""Structured output: keep the output inside a grammar (JSON schema, regex, choice list, Lark).

Before sampling, each constrained request gets a token bitmask from its grammar's matcher; the
runner sets the other logits to -inf, so any pick keeps the text valid. With speculative decoding a
request needs k + 1 masks: the matcher walks through the drafts, then rolls back, so rejected drafts
leave no trace. The engine is llguidance (also vLLM's): a small wheel that runs on any CPU, where
xgrammar needs tvm-ffi, pydantic and triton."""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from minivllm.sampling_params import StructuredOutputsParams


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        schema = json.loads(schema) if isinstance(schema, str) else dict(schema)
        # fixed separators and no free whitespace: a model cannot wander off into endless newlines
        rigid = {"x-guidance": {"whitespace_flexible": False}}
        return LLMatcher.grammar_from_json_schema({**schema, **rigid})
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))  # Lark as is; GBNF converted


class StructuredOutputManager:
    """The matchers of the constrained requests, keyed by request id, and the bitmasks they give."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.matchers: dict = {}

    @functools.cached_property
    def ll_tokenizer(self):
        """Built on first use: it walks the whole vocabulary. Every id that ends a sequence is an
        end for the grammar too, so none of them can slip into the text. llguidance 1.6 (what pip
        finds on some platforms) takes one end id: the first then ends a finished grammar, and the
        others, special tokens, still match no text."""
        import llguidance.hf

        ends = self.eos_token_ids or None
        build = functools.partial(llguidance.hf.from_tokenizer, self.hf_tokenizer,
                                  n_vocab=self.vocab_size)
        try:
            return build(eos_token=ends)
        except TypeError:  # 'list' object cannot be interpreted as an integer
            return build(eos_token=ends[0])

    def validate(self, spec: StructuredOutputsParams) -> str:
        """The grammar for `spec`, or a ValueError saying why it cannot be used, before any work."""
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(spec)
        except Exception as e:  # bad JSON, a schema or regex llguidance rejects: all one error here
            raise ValueError(f"structured outputs: {e}") from e
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"structured outputs: invalid grammar: {error}")
        return grammar

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        from llguidance import LLMatcher

        self.matchers[request_id] = LLMatcher(self.ll_tokenizer, self.validate(spec))

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def active(self) -> bool:
        return bool(self.matchers)

    def constrains(self, request_id: str) -> bool:
        return request_id in self.matchers

    def bitmask(self, requests: list[tuple[str, list[int]]]) -> tuple[np.ndarray, dict[str, int]]:
        """Masks for (request id, drafts) pairs: 1 + len(drafts) rows each. Returns the int32
        bitmask [rows, words] and each request's first row."""
        import llguidance.torch as ll_torch

        rows = sum(1 + len(drafts) for _, drafts in requests)
        mask = ll_torch.allocate_token_bitmask(rows, self.vocab_size)
        first, row = {}, 0
        for rid, drafts in requests:
            matcher, consumed = self.matchers[rid], 0
            first[rid] = row
            for i in range(len(drafts) + 1):
                ll_torch.fill_next_token_bitmask(matcher, mask, row + i)
                if (i < len(drafts) and consumed == i
                    and matcher.try_consume_tokens([drafts[i]]) == 1):
                    consumed += 1
            if consumed:
                matcher.rollback(consumed)
            row += len(drafts) + 1
        return mask.numpy(), first

    def can_end(self, request_id: str) -> bool:
        """Whether the output so far is complete under the grammar (an EOS id may then end it)."""
        return self.matchers[request_id].is_accepting()

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the grammar over a token the request produced; True once it is complete."""
        matcher = self.matchers[request_id]
        matcher.consume_token(token)
        return matcher.is_stopped() or matcher.is_error()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of tokens whose bit is clear: logits [n, vocab], bitmask
    [n, words]."""
    bits = torch.from_numpy(bitmask).to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    logits.masked_fill_(~allowed, float("-inf"))
