"""Small helpers every part shares (vLLM keeps the same ones in `vllm.utils`)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size `b` hold `a` tokens."""
    return -(a // -b)
