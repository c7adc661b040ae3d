"""`python -m minivllm.entrypoints.openai.api_server --model M`: vLLM's older server command, the
same server as `minivllm serve M`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.entrypoints.arg_parser import FlexibleArgumentParser
from minivllm.entrypoints.openai.cli_args import load_chat_template, make_arg_parser


def run_server(args: argparse.Namespace) -> int:
    """Serve with parsed arguments until SIGTERM or Ctrl-C; 2 (reason on stderr) for bad ones."""
    try:
        from minivllm.server import serve
        from minivllm.server.limits import ServerLimits
    except ImportError as e:
        print(f"error: {e}; install the server extra: pip install 'minivllm[serve]'",
              file=sys.stderr)
        return 2
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        limits = ServerLimits(args.max_request_bytes, min(args.max_n, 128), args.max_tokens_times_n)
        serve(host=args.host, port=args.port, log_level=args.log_level, log_format=args.log_format,
              api_key=args.api_key, allowed_origins=args.allowed_origins,
              shutdown_timeout=args.shutdown_timeout,
              limits=limits, chat_template=load_chat_template(args.chat_template),
              engine_config=engine_args.create_engine_config())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads; once serving, it is a clean shutdown
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_arg_parser(FlexibleArgumentParser(
        prog="python -m minivllm.entrypoints.openai.api_server",
        description="an OpenAI-compatible HTTP server (the same as `minivllm serve MODEL`)"))
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
