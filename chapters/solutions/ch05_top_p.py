"""Reference solution, chapter 05: top-p (nucleus) filtering."""

import torch


def my_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each one
    drop_sorted = before >= top_p[:, None]  # already reached top_p without it (the top token: before = 0)
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))
