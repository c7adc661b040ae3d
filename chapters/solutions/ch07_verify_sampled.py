"""Reference solution, chapter 07: the rejection-sampling rule for drafted tokens."""

import torch


def my_verify_sampled(target_probs, draft, draft_probs, generator) -> list[int]:
    out = []
    for i, d in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(torch.tensor(d), len(p)).to(p)
        if torch.rand((), generator=generator) * q[d] < p[d]:  # u < p(d) / q(d): keep the draft
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)  # rejected: draw from where the target wants more than the drafter gave
        out.append(int(torch.multinomial(residual / residual.sum() if residual.sum() > 0 else p, 1,
                                         generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))  # all kept: a bonus
    return out
