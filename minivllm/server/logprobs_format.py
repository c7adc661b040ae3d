"""The engine's per-position `{token id: Logprob}` dicts in OpenAI's two formats: completions'
parallel lists (tokens, token_logprobs, top_logprobs, text_offset), chat's one object per token."""

from __future__ import annotations

from minivllm.outputs import Logprob


def _top(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at a position (the chosen one only if it is among them)."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k),
                  key=lambda item: item[1].rank)[:k]


def _text(token: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token}"


def completion_logprobs(token_ids: list[int], positions: list[dict[int, Logprob] | None], k: int,
                        text_offset: int = 0) -> dict:
    """OpenAI completions' `logprobs` object for these tokens; a None position (the first prompt
    token when echoing) gets a null logprob, as OpenAI's own echo does."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, position in zip(token_ids, positions):
        lp = position.get(token) if position else None
        text = _text(token, lp) if lp is not None else ""
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob if lp is not None else None)
        top: dict[str, float] = {}
        for t, p in _top(position, k) if position else ():
            # two byte pieces may read alike: the likelier one keeps the key
            top.setdefault(_text(t, p), p.logprob)
        out["top_logprobs"].append(top if position else None)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict:
    """OpenAI chat's `logprobs` object: `content`, one entry per generated token."""
    def entry(token: int, lp: Logprob) -> dict:
        text = _text(token, lp)
        return {"token": text, "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(token, position[token]),
                         "top_logprobs": [entry(t, p) for t, p in _top(position, k)]}
                        for token, position in zip(token_ids, positions)]}
