"""InputProcessor: a prompt and its SamplingParams become n validated, tokenized Sequences.

Everything that can be wrong with a request is found here, before it is queued: a bad prompt fails
alone with a ValueError naming the problem, and the engine never starts work it cannot finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from minivllm.config import EngineConfig
from minivllm.core.math_utils import cdiv
from minivllm.core.sequence import Sequence
from minivllm.sampling.logits_processor import load_logits_processor_classes
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output import StructuredOutputManager
from minivllm.tokenizer import Tokenizer

PromptType = str | list[int] | dict


@dataclass
class EngineRequest:
    """One user request, ready to queue: its prompt as given and as ids, and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[Sequence]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None,
                 eos_token_ids: tuple[int, ...], num_kv_blocks: int,
                 structured: StructuredOutputManager | None = None) -> None:
        self.config, self.tokenizer, self.structured = config, tokenizer, structured
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_ids, self.num_kv_blocks = eos_token_ids, num_kv_blocks
        self.num_groups = config.kv_groups.num_groups
        self.logits_processor_classes = load_logits_processor_classes(config.logits_processors)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                arrival_time: float | None = None, priority: int = 0) -> EngineRequest:
        """Validate and tokenize one request (n sequences), not queueing it: errors before work."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"got priority {priority} but scheduling_policy is "
                             f"{self.config.scheduling_policy!r}: use scheduling_policy='priority'")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]  # the last k, as vLLM keeps
        self._check_params(params)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}, "
                             f"which leaves no room for output")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        num, seq_params = params.num_sequences, params
        if params.ranks_by_logprob and params.logprobs is None:
            # best_of ranks by logprob: the runner must report each chosen token's (0 alternatives)
            seq_params = replace(params, logprobs=0)
        sequences = [Sequence(request_id if num == 1 else f"{request_id}#{i}", list(ids),
                              seq_params, self.eos_token_ids, max_len, arrival,
                              parent_id=request_id, index=i, priority=priority) for i in range(num)]
        # a block of tokens takes a block of every group of layers (core/kv_groups.py)
        need = cdiv(sequences[0].max_total_tokens, self.config.block_size) * self.num_groups
        if need > self.num_kv_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the cache has only "
                             f"{self.num_kv_blocks}: lower max_tokens or add blocks")
        return EngineRequest(request_id, text, list(ids), params, arrival, sequences)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams alone cannot check: ids against the vocabulary, words and grammars
        against the tokenizer, the logprobs asked for against max_logprobs (as vLLM's processor: -1,
        the whole vocabulary, only when max_logprobs is -1 too, since it costs vocab-size entries
        per position). Bad words become token ids here (vLLM's update_from_tokenizer)."""
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and cap != -1 and (asked == -1 or asked > cap):
                raise ValueError(f"SamplingParams.{name}: requested "
                                 f"{'all' if asked == -1 else asked} logprobs, more than this "
                                 f"engine's max_logprobs of {cap}")
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):  # logit_bias: its keys
            bad = [t for t in getattr(params, name) or [] if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} outside the vocabulary [0, "
                                 f"{self.vocab_size}): {bad[:5]}")
        needs = [name for name in ("bad_words", "structured_outputs") if getattr(params, name)]
        if needs and self.tokenizer is None:
            raise ValueError(f"{needs[0]} needs a tokenizer, and {self.config.model} has none")
        if params.bad_words and not params.bad_words_token_ids:
            words = {tuple(self.tokenizer.hf(prefix + w.strip(),
                                             add_special_tokens=False).input_ids)
                     for w in params.bad_words for prefix in ("", " ")}
            params.bad_words_token_ids = [list(w) for w in sorted(words) if w]
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        for cls in self.logits_processor_classes:  # custom logits processors check their extra_args
            cls.validate_params(params)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: pass prompt_token_ids "
                                 f"instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got "
                         f"{type(prompt).__name__}")
