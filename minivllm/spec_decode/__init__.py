"""Speculative decoding: cheap proposers of the next few tokens, which the target model then verifies."""

from minivllm.spec_decode.draft_model import DraftModelProposer
from minivllm.spec_decode.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer"]
