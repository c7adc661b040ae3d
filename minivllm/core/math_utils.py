"""Small arithmetic every part shares (vLLM keeps it at `vllm.utils.math_utils`, too)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size `b` hold `a` tokens."""
    return -(a // -b)
