"""SamplingParams: how one request turns logits into tokens, with vLLM's field names and defaults."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy, as in vLLM: dividing logits by ~1e-39 overflows to inf/NaN.
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """Which steps report a request: every step that advanced it (streaming), or only its last one.

    `LLM.generate` asks for FINAL_ONLY, as vLLM's does: building a cumulative output for every running
    request on every step costs more than the step itself at large batch sizes.
    """

    CUMULATIVE = "cumulative"  # the whole text and token ids so far, every step
    DELTA = "delta"  # only what is new since the request's last output
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """Per-request decoding settings. Validation happens here, before any work starts.

    temperature 0 (or below 1e-5) means greedy; top_k 0 (or -1) and top_p 1 disable those filters, as in vLLM.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) at the end of the text
    seed: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def number(value) -> bool:  # a real, finite number: NaN and inf would poison every logit
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not number(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a number >= 0")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be an integer: -1 or 0 disables it, otherwise >= 1")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_strings = stop
        ids = self.stop_token_ids or []
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            fail("stop_token_ids", "must be a list of non-negative integers")
        self.stop_token_ids = list(ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind")
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
