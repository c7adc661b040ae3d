"""StepCounters: the engine's running totals, kept by a step observer, for `LLMEngine.stats()`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.trace import StepRecord


class StepCounters:
    """Each attribute is a key of `as_dict()`, under the same name."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0
        self.spec_num_proposed = self.spec_num_accepted = self.spec_num_steps = 0
        self.spec_num_accepted_per_pos: list[int] = []  # [i]: drafts accepted at draft position i
        self.spec_propose_seconds = 0.0

    def __call__(self, engine: LLMEngine, record: StepRecord) -> None:
        self.num_steps += 1
        accepted = record.runner_output.num_accepted
        for s in record.scheduler_output.scheduled:
            if s.is_prefill:
                self.num_prefill_tokens_computed += s.num_new_tokens
            else:
                self.num_decode_tokens += s.num_new_tokens
            if s.request_id in accepted:
                self.spec_num_proposed += len(s.spec_token_ids)
                num_accepted = accepted[s.request_id]
                self.spec_num_accepted += num_accepted
                self.spec_num_steps += 1
                per_pos = self.spec_num_accepted_per_pos
                per_pos += [0] * (len(s.spec_token_ids) - len(per_pos))
                # drafts are accepted as a prefix: positions 0..accepted-1
                for i in range(num_accepted):
                    per_pos[i] += 1
        self.num_generated_tokens += sum(len(c.new_token_ids) for c in record.core_outputs)
        self.spec_propose_seconds += record.runner_output.propose_seconds

    def as_dict(self) -> dict:
        steps, accepted = self.spec_num_steps, self.spec_num_accepted
        return {**vars(self), "spec_num_accepted_per_pos": list(self.spec_num_accepted_per_pos),
                "spec_acceptance_rate": accepted / max(self.spec_num_proposed, 1),
                # tokens gained per verification step: the accepted drafts plus the target's own
                "spec_mean_accepted_length": (accepted + steps) / max(steps, 1)}
