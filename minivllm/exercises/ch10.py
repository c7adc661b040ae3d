"""Chapter 10 exercise: which tokens go into the text, an id past the tokenizer's vocabulary
(a padded embedding row) included.

The checker asks the rule about tokens with a known answer, then plugs it into the engine's own
Tokenizer (`EngineHooks(keep_token=...)`, the one the engine builds) and streams token ids through
its incremental detokenizer, padded ids and special tokens among them: every step's text must equal
that of the engine's own rule. Last, a whole generation through the engine must give the same text.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.exercises.common import PROMPTS
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks
from minivllm.sampling_params import SamplingParams
from minivllm.tokenizer import Tokenizer


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    state = tok.start_detokenizer(2, skip_special_tokens=skip)
    return [tok.detokenize_step(ids[:n], state) for n in range(3, len(ids) + 1)]


def check_keep_token(keep_fn: Callable) -> Report:
    """Grade `keep_token(token: str | None, is_special: bool, skip_special_tokens: bool)`: whether
    the token goes into the text."""
    def known_answers():
        cases = [(("▁cat", False, True), True, "an ordinary token"),
                 ((None, False, True), False, "None (an id past the tokenizer's vocabulary: the "
                                              "checkpoint's padded embedding rows)"),
                 ((None, False, False), False, "None with skip_special_tokens=False"),
                 (("</s>", True, True), False, "a special token with skip_special_tokens=True"),
                 (("</s>", True, False), True, "a special token with skip_special_tokens=False")]
        for args, want, what in cases:
            got = keep_fn(*args)
            if bool(got) != want:
                raise ExerciseFailure(f"for {what}, your rule said {got}; it should say {want}: "
                                      f"an id past the vocabulary has no text and decodes to "
                                      f"nothing (never an error), and special tokens go into the "
                                      f"text only when skip_special_tokens is False.")

    def detokenizer_stream():
        engine = LLMEngine(EngineConfig(DEFAULT_MODEL, hooks=EngineHooks(keep_token=keep_fn),
                                        num_kv_blocks=8, trace_steps=0, device="cpu"))
        ours, theirs = Tokenizer(engine.config.tokenizer), engine.tokenizer
        vocab, eos = ours.vocab_size, ours.eos_token_id
        ids = ours.encode("Once upon a time") + [vocab + 3] + ours.encode("there was a dog")[1:]
        ids += [eos, vocab, vocab + 5] + ours.encode("named Max")[1:]
        for skip in (True, False):
            got, want = _stream(theirs, ids, skip), _stream(ours, ids, skip)
            if got != want:
                n = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                raise ExerciseFailure(
                    f"the engine's detokenizer with your rule (skip_special_tokens={skip}) gave "
                    f"{got[n]!r} for token {ids[n + 2]} (vocabulary: {vocab} ids), its own rule "
                    f"{want[n]!r}.")

    def engine_equality():
        params = SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False)
        texts = [[o.outputs[0].text for o in LLM(DEFAULT_MODEL, hooks=hooks, trace_steps=0,
                                                 device="cpu").generate(PROMPTS, params,
                                                                        use_tqdm=False)]
                 for hooks in (EngineHooks(), EngineHooks(keep_token=keep_fn))]
        if texts[0] != texts[1]:
            i = next(i for i, (a, b) in enumerate(zip(*texts)) if a != b)
            raise ExerciseFailure(f"request {i} of a generation through the engine came out as "
                                  f"{texts[1][i]!r} with your rule, {texts[0][i]!r} with its own.")

    return run_checks("ch10 keep_token", [
        ("the rule is right on tokens with a known answer", known_answers),
        ("the engine's detokenizer streams the same text, padded ids included",
         detokenizer_stream),
        ("a generation through the engine gives the same text", engine_equality)])
