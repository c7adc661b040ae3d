"""Logprobs as vLLM reports them: from the raw logits (before grammar, penalties or temperature).

Only the sequences that asked pay: one log-softmax over just their rows. Prompt positions go
straight into the step's output; sample rows wait on their `StepRow` for the tokens to be chosen.
"""

from __future__ import annotations

import torch

from minivllm.core.step_io import RunnerOutput, TokenLogprobs
from minivllm.runner.step_batch import StepRow


def raw_logprobs(rows: list[StepRow], logits: torch.Tensor, out: RunnerOutput) -> None:
    """Log-softmax of asking rows' logits: prompt logprobs into `out`, sampled ones on the row."""
    for row in rows:
        st = row.state
        wants_sample = st.params.logprobs is not None and row.samples
        if not (wants_sample or row.all_logits):
            continue
        logprobs = torch.log_softmax(logits[row.logit_rows.start : row.logit_rows.stop].float(),
                                     dim=-1)
        if wants_sample:
            row.raw_logprobs = logprobs[row.sample_rows.start - row.logit_rows.start :]
        # row j sits at position num_computed + j and predicts the next prompt token
        if row.all_logits:
            start, done = row.num_computed, st.num_prompt_logprobs_done
            targets = range(max(start + 1, done),
                            min(start + row.num_new + 1, st.num_prompt_tokens))
            out.prompt_logprobs[st.request_id] = [
                token_logprobs(logprobs[t - 1 - start], st.token_ids[t], st.params.prompt_logprobs)
                for t in targets]
            st.num_prompt_logprobs_done = max(done, targets.stop)


def sampled_logprobs(row: StepRow) -> list[TokenLogprobs] | None:
    """Logprobs of the tokens a row sampled (accepted drafts and the new one), if it asked."""
    if row.raw_logprobs is None:
        return None
    k = row.state.params.logprobs
    return [token_logprobs(row.raw_logprobs[j], tok, k) for j, tok in enumerate(row.sampled)]


def token_logprobs(row: torch.Tensor, token: int, k: int | None) -> TokenLogprobs:
    """A position's logprobs from its log-softmax row: the token there, then the top k (-1: all)."""
    k = row.shape[-1] if k is None or k < 0 else k
    ids, values = [token], [float(row[token])]
    if k:
        top = row.topk(k)
        ids, values = ids + top.indices.tolist(), values + top.values.tolist()
    rank = int((row > row[token]).sum()) + 1
    return TokenLogprobs(ids, values, [rank] + list(range(1, k + 1)))
