"""vLLM's import path `vllm.utils`: FlexibleArgumentParser (entrypoints/arg_parser.py) and `cdiv`.

One of the thin modules that let vLLM code run with only `vllm` -> `minivllm` changed; the README's
"vLLM import paths" table lists them all.
"""

from minivllm.core.math_utils import cdiv
from minivllm.entrypoints.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser", "cdiv"]
