"""vLLM's import path `vllm.utils.argparse_utils` (newer vLLM's home of FlexibleArgumentParser): a
re-export."""

from minivllm.entrypoints.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
