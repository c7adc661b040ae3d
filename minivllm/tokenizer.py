"""Tokenizer: text <-> token ids through transformers' AutoTokenizer, and incremental detokenizing.

Decoding one token at a time is wrong for byte-level BPE and SentencePiece: a character may span
several tokens, and spaces depend on the token before. So each step decodes a small window of recent
tokens twice (with and without the new ones) and emits only the difference, holding back text that
ends in the replacement character U+FFFD (an unfinished multi-byte character).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class DetokenizerState:
    prefix_offset: int  # start of the context window, in all_token_ids
    read_offset: int  # tokens before this are already turned into text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def keep_token(token: str | None, is_special: bool, skip_special_tokens: bool) -> bool:
    """Whether a token goes into the text. None is an id past the tokenizer's vocabulary: real
    checkpoints pad their embedding matrix (Qwen2: 151,936 rows for 151,646 tokens) and a model can
    sample such an id; like vLLM, it decodes to nothing. Special tokens go only if not skipped."""
    return token is not None and not (skip_special_tokens and is_special)


class Tokenizer:
    def __init__(self, path: str | Path,
                 keep: Callable[[str | None, bool, bool], bool] | None = None) -> None:
        """keep: which tokens make it into text (EngineHooks.keep_token), None: `keep_token`."""
        from transformers import AutoTokenizer

        path = Path(path)
        # a GGUF file: transformers builds the tokenizer from the file's own metadata
        gguf = {"gguf_file": path.name} if path.is_file() else {}
        self.hf = AutoTokenizer.from_pretrained(path.parent if gguf else path, **gguf,
                                                local_files_only=True)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self.special_tokens = set(self.hf.all_special_tokens)  # a property that rebuilds a list
        self.keep = keep or keep_token

    def encode(self, text: str) -> list[int]:
        return self.hf(text).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> tuple[str, list[int]]:
        """The conversation rendered by the chat template (kwargs: transformers' own): text, ids."""
        kwargs.setdefault("add_generation_prompt", True)
        text = self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        return text, self.hf(text, add_special_tokens=False).input_ids

    def start_detokenizer(self, num_prompt_tokens: int, skip_special_tokens: bool = True,
                          spaces_between_special_tokens: bool = True) -> DetokenizerState:
        """The window starts 5 prompt tokens back: the first output token gets its leading space."""
        return DetokenizerState(max(num_prompt_tokens - 5, 0), num_prompt_tokens,
                                skip_special_tokens, spaces_between_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token alone as text (a logprob's decoded_token); "" for an id beyond the vocab."""
        return self._join(self.hf.convert_ids_to_tokens([token_id]), skip_special_tokens=False)

    def detokenize_step(self, all_token_ids: list[int], state: DetokenizerState) -> str:
        """Text of the tokens after `state.read_offset` ("" while a character is still split)."""
        prefix_text, full_text = self._window(all_token_ids, state)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            state.prefix_offset, state.read_offset = state.read_offset, len(all_token_ids)
            return full_text[len(prefix_text) :]
        return ""

    def detokenize_rest(self, all_token_ids: list[int], state: DetokenizerState) -> str:
        """What detokenize_step would emit token by token, in one decode (for a request nobody reads
        until it finishes); replayed step by step only if it ends inside an unfinished character."""
        prefix_text, full_text = self._window(all_token_ids, state)
        if not full_text.endswith("\ufffd"):
            state.prefix_offset, state.read_offset = state.read_offset, len(all_token_ids)
            return full_text[len(prefix_text) :]
        return "".join(self.detokenize_step(all_token_ids[:end], state)
                       for end in range(state.read_offset + 1, len(all_token_ids) + 1))

    def _window(self, all_token_ids: list[int], state: DetokenizerState) -> tuple[str, str]:
        """The text of the window without the unread tokens, and with them."""
        tokens = self.hf.convert_ids_to_tokens(all_token_ids[state.prefix_offset :])
        prefix = tokens[: state.read_offset - state.prefix_offset]
        options = (state.skip_special_tokens, state.spaces_between_special_tokens)
        return self._join(prefix, *options), self._join(tokens, *options)

    def _join(self, tokens: list[str | None], skip_special_tokens: bool = True,
              spaces_between_special_tokens: bool = True) -> str:
        """Tokens to text: those `self.keep` keeps (`keep_token`: no id past the vocabulary, no
        skipped special token); special ones set apart by spaces, as transformers' slow tokenizers
        do, if spaces_between_special_tokens."""
        special = self.special_tokens
        tokens = [t for t in tokens if self.keep(t, t in special, skip_special_tokens)]
        parts = []  # each special token alone, each run of other tokens as one string
        for is_special, group in itertools.groupby(tokens, key=special.__contains__):
            run = list(group)
            parts += run if is_special else [self.hf.convert_tokens_to_string(run)]
        return (" " if spaces_between_special_tokens else "").join(parts)


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters: (its start, the
    string)."""
    best = None
    for stop in stops:
        start = text.find(stop, max(len(text) - new_len - len(stop) + 1, 0))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
