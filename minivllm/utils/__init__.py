"""vLLM's import path `vllm.utils`: re-exports FlexibleArgumentParser (defined in entrypoints/arg_parser.py).

One of the thin modules that let vLLM code run with only `vllm` -> `minivllm` changed; the README's
"vLLM import paths" table lists them all.
"""

from minivllm.entrypoints.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
