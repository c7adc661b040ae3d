"""Verifying drafted tokens so that speculative decoding changes the speed, never the output.

Greedy: keep drafts while they equal the target's argmax; at the first disagreement take the
target's token instead. If all k agree, the target's prediction after them is a free bonus token.
The output is exactly what plain greedy decoding would produce.

Sampling (Leviathan et al. / Chen et al.): accept draft d with probability min(1, p(d) / q(d)),
where p is the target's and q the drafter's distribution; at the first rejection draw from
normalise(max(0, p - q)). Every emitted token is then distributed exactly as if the target had
sampled it alone. A drafter with no distribution (n-gram lookup) is a point mass: q(d) = 1.
"""

from __future__ import annotations

import torch

from minivllm.sampling.sampler import first_argmax


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """target_logits: [k+1, vocab] at the last token and each draft -> the tokens to append."""
    best = first_argmax(target_logits).tolist()
    out = []
    for i, d in enumerate(draft):
        out.append(best[i])
        if best[i] != d:
            return out
    out.append(best[len(draft)])
    return out


def verify_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """target_probs: [k+1, vocab]; draft_probs: [k, vocab] or None (point mass) -> tokens to add."""
    out = []
    for i, d in enumerate(draft):
        p = target_probs[i]
        q = (draft_probs[i] if draft_probs is not None
             else torch.zeros_like(p).index_fill_(0, torch.tensor(d), 1.0))
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[d] < p[d]:  # u < p/q, without dividing by a q that may be 0 nowhere else
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))
    return out
