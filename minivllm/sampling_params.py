"""SamplingParams: how one request turns logits into tokens, with vLLM's names and defaults."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from minivllm.keyword_args import ANY, refuse_unknown_kwargs

# Temperatures below this are greedy, as in vLLM: dividing logits by ~1e-39 overflows to inf/NaN.
SAMPLING_EPS = 1e-5
# OpenAI's documented range is [-100, 100]: beyond it a token is already certain or banned
MAX_LOGIT_BIAS = 100.0
# a logit is divided or multiplied by it: keep float32 far from overflow
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# the smallest normal float32: top_p below it would round to 0 in the sampler
FLOAT32_TINY = 1.1754943508222875e-38


class RequestOutputKind(enum.Enum):
    """Which steps report a request. `LLM.generate` asks for FINAL_ONLY, as vLLM's does: cumulative
    outputs for every running request every step cost more than the step at large batch sizes."""

    CUMULATIVE = "cumulative"  # the whole text and token ids so far, every step
    DELTA = "delta"  # only what is new since the request's last output
    FINAL_ONLY = "final_only"


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's StructuredOutputsParams): exactly one of these."""

    json: str | dict | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # a Lark grammar (llguidance's format; GBNF is converted)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        for name, kinds in (("json", (str, dict)), ("regex", (str,)), ("grammar", (str,)),
                            ("json_object", (bool,))):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kinds):
                raise ValueError(f"structured outputs: {name} must be a "
                                 f"{' or '.join(k.__name__ for k in kinds)}, got "
                                 f"{type(value).__name__}")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c
                                                                   for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty "
                             "strings")


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def _number(value) -> bool:
    """A real, finite number: NaN and inf would poison every logit."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request decoding settings. Validation happens here, before any work starts.

    temperature 0 (or below 1e-5) means greedy; top_k 0 (or -1) and top_p 1 disable those filters,
    as in vLLM. The order of operations (sampling/sampler.py) is vLLM's: allowed_token_ids and
    bad_words masks, min_tokens and logit_bias, then the repetition / frequency / presence
    penalties, then temperature, min_p, top_k, top_p. logprobs are the model's own, before any of
    that (vLLM's default "raw_logprobs").
    """

    n: int = 1
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) prompt and output tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # never produced (as tokens, with or without a space)
    include_stop_str_in_output: bool = False  # keep the stop string/token's text at the end
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logprobs: int | None = None  # per generated token: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for every prompt token (the first gets None)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # structured_outputs' older name
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = None  # free-form, for custom logits processors (vLLM's)
    # vLLM V0's best_of: sample best_of sequences, return the n with the highest cumulative logprob
    # (the request is then reported only when it finishes: which n win is known only at the end)
    best_of: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # set on arrival
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_stops_and_tokens()
        self._check_structured_and_extras()
        self.top_k = max(self.top_k, 0)  # -1 disables it, as 0 does
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0

    def _fail(self, name: str, why: str) -> None:
        raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    def _check_numbers(self) -> None:
        """The counts, penalties and filters: each a number in its range (NaN and inf never are)."""
        if not _integer(self.n) or self.n < 1:
            self._fail("n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                self._fail(name, "must be a number in [-2, 2]")
        if not _number(self.temperature) or self.temperature < 0:
            self._fail("temperature", "must be a number >= 0")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            self._fail("top_p", "must be in (0, 1]")
        # 1e-46 is 0 in float32, which would drop even the top token
        self.top_p = max(self.top_p, FLOAT32_TINY)
        if not _integer(self.top_k) or self.top_k < -1:
            self._fail("top_k", "must be an integer: -1 or 0 disables it, otherwise >= 1")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            self._fail("min_p", "must be in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not _number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            self._fail("repetition_penalty",
                 f"must be in [{low}, {high}] (1 is off; 1e-50 would overflow float32 logits)")
        if self.max_tokens is not None and (not _integer(self.max_tokens) or self.max_tokens < 1):
            self._fail("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)")
        if not _integer(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            self._fail("min_tokens", "must be an integer in [0, max_tokens]")
        if self.seed is not None and not _integer(self.seed):
            self._fail("seed", "must be an integer or None")
        for name in ("logprobs", "prompt_logprobs"):  # the engine's max_logprobs caps them
            value = getattr(self, name)
            if value is not None and (not _integer(value) or value < -1):
                self._fail(name, "must be None, -1 (the whole vocabulary) or an integer >= 0")
        if self.truncate_prompt_tokens is not None and (
                not _integer(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            self._fail("truncate_prompt_tokens", "must be an integer >= 1")

    def _check_stops_and_tokens(self) -> None:
        """The flags, stop strings and the token lists and maps, kept as lists and ints."""
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "must be True or False")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            self._fail("stop", "must be a string or a list of strings")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            self._fail("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_strings = stop
        if stop and not self.detokenize:
            self._fail("stop", "needs detokenize=True (stop strings are found in the text)")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and (not isinstance(ids, (list, tuple)) or
                                    not all(_integer(t) and t >= 0 for t in ids)):
                self._fail(name, "must be a list of non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                self._fail("allowed_token_ids", "must not be empty (nothing could be sampled)")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _integer(int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k)
                    and _number(v) and abs(v) <= MAX_LOGIT_BIAS
                    for k, v in self.logit_bias.items()):
                self._fail("logit_bias", f"must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, "
                                         f"{MAX_LOGIT_BIAS:g}]")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or
                                           not all(isinstance(w, str) and w.strip()
                                                   for w in self.bad_words)):
            self._fail("bad_words", "must be a list of non-empty strings")

    def _check_structured_and_extras(self) -> None:
        """Structured outputs (guided_decoding: the old name), output_kind, extra_args, best_of."""
        for name in ("guided_decoding", "structured_outputs"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name),
                                                                  StructuredOutputsParams):
                self._fail(name, "must be a StructuredOutputsParams")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                self._fail("guided_decoding", "and structured_outputs cannot both be set")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if not isinstance(self.output_kind, RequestOutputKind):
            self._fail("output_kind", "must be a RequestOutputKind")
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and all(
                isinstance(k, str) for k in self.extra_args)):
            self._fail("extra_args", "must be a dict with string keys")
        if self.best_of is not None and (not _integer(self.best_of) or self.best_of < self.n):
            self._fail("best_of", f"must be an integer >= n ({self.n})")

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine samples: best_of when set, else n."""
        return max(self.n, self.best_of or 0)

    @property
    def ranks_by_logprob(self) -> bool:
        """best_of > n: the engine samples more sequences than it returns, keeps the likeliest n."""
        return self.num_sequences > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def position_dependent(self) -> bool:
        """Processing that depends on the tokens before each position (penalties, bad words,
        min_tokens): a draft's k positions cannot share one logits adjustment, so no drafts."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.bad_words) or self.min_tokens > 0)


# vLLM's fields that minivllm lacks: accepted at values that ask for nothing, else a ValueError
VLLM_ONLY_FIELDS = {
    "flat_logprobs": (False,), "repetition_detection": (None,), "thinking_token_budget": (None,),
    "logits_processors": (None, []),  # per-request processors are gone in vLLM v1 too
    "skip_clone": ANY, "output_text_buffer_length": ANY,  # a copy-avoiding hint; an internal field
    "skip_reading_prefix_cache": (None, False),
}
refuse_unknown_kwargs(SamplingParams, VLLM_ONLY_FIELDS)
refuse_unknown_kwargs(StructuredOutputsParams)
