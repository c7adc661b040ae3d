"""vLLM's import path `vllm.utils.math_utils`: a re-export of minivllm/core/math_utils.py."""

from minivllm.core.math_utils import cdiv

__all__ = ["cdiv"]
