"""StepCounters: the engine's running totals, kept by a step observer (what `LLMEngine.stats()`
reports)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.engine.trace import StepRecord


class StepCounters:
    def __init__(self) -> None:
        self.num_steps = 0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0
        self.num_spec_proposed = self.num_spec_accepted = self.num_spec_steps = 0
        self.num_spec_accepted_per_pos: list[int] = []  # [i]: drafts accepted at draft position i
        self.propose_seconds = 0.0

    def __call__(self, engine: LLMEngine, record: StepRecord) -> None:
        self.num_steps += 1
        accepted = record.runner_output.num_accepted
        for s in record.scheduler_output.scheduled:
            if s.is_prefill:
                self.num_prefill_tokens_computed += s.num_new_tokens
            else:
                self.num_decode_tokens += s.num_new_tokens
            if s.request_id in accepted:
                self.num_spec_proposed += len(s.spec_token_ids)
                num_accepted = accepted[s.request_id]
                self.num_spec_accepted += num_accepted
                self.num_spec_steps += 1
                per_pos = self.num_spec_accepted_per_pos
                per_pos += [0] * (len(s.spec_token_ids) - len(per_pos))
                # drafts are accepted as a prefix: positions 0..accepted-1
                for i in range(num_accepted):
                    per_pos[i] += 1
        self.num_generated_tokens += sum(len(c.new_token_ids) for c in record.core_outputs)
        self.propose_seconds += record.runner_output.propose_seconds

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_prefill_tokens_computed": self.num_prefill_tokens_computed,
            "num_decode_tokens": self.num_decode_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "spec_num_proposed": self.num_spec_proposed,
            "spec_num_accepted": self.num_spec_accepted,
            "spec_num_steps": self.num_spec_steps,
            "spec_num_accepted_per_pos": list(self.num_spec_accepted_per_pos),
            "spec_acceptance_rate": self.num_spec_accepted / max(self.num_spec_proposed, 1),
            # tokens gained per verification step: the accepted drafts plus the target's own token
            "spec_mean_accepted_length": ((self.num_spec_accepted + self.num_spec_steps)
                                          / max(self.num_spec_steps, 1)),
            "spec_propose_seconds": self.propose_seconds,
        }
