"""vLLM's `vllm.utils`: FlexibleArgumentParser and `cdiv` (re-exports)."""

from minivllm.core.math_utils import cdiv
from minivllm.entrypoints.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "cdiv"]
