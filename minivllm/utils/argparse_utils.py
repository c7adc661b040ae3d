"""vLLM's `vllm.utils.argparse_utils` (a re-export)."""

from minivllm.entrypoints.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
