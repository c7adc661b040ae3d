"""Speculative decoding: cheap proposers of the next few tokens, which the target then verifies."""

from __future__ import annotations

from minivllm.config import NGRAM, EngineConfig
from minivllm.spec_decode.draft_model import DraftModelProposer, draft_memory_needs
from minivllm.spec_decode.ngram import NgramProposer
from minivllm.spec_decode.proposer import Draft, Proposer

__all__ = ["Draft", "DraftModelProposer", "NgramProposer", "Proposer", "draft_memory_needs",
           "make_proposer"]


def make_proposer(config: EngineConfig, num_target_blocks: int, vocab_size: int) -> Proposer | None:
    """The drafter `config.speculative_model` names: None (off), NGRAM ("[ngram]"), or a draft
    checkpoint."""
    if config.speculative_model is None:
        return None
    if config.speculative_model == NGRAM:
        return NgramProposer(config.num_speculative_tokens)
    return DraftModelProposer(config, vocab_size, num_target_blocks)
