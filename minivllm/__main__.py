"""Command line: `minivllm generate "Hi, my name is" --max-tokens 32`, or `minivllm serve [MODEL]`;
both read the engine's flags from EngineArgs (engine/arg_utils.py), as vLLM's CLI does."""

from __future__ import annotations

import argparse
import sys

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.journey import format_journey
from minivllm.entrypoints.arg_parser import FlexibleArgumentParser
from minivllm.entrypoints.openai.api_server import run_server
from minivllm.entrypoints.openai.cli_args import make_arg_parser


def main(argv: list[str] | None = None) -> int:
    parser = FlexibleArgumentParser(prog="minivllm")
    parser.add_argument("--version", action="version", version=f"%(prog)s {minivllm.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    sampling = gen.add_argument_group("sampling parameters")
    sampling.add_argument("--max-tokens", type=int, default=32)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--journey", action="store_true", help="print what each engine step did")
    EngineArgs.add_cli_args(gen)
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="checkpoint directory or Hub id (or --model), served under that name")
    make_arg_parser(srv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.model_tag is not None:
            if args.model not in (None, args.model_tag):
                parser.error(f"serve got two models: {args.model_tag!r} and --model {args.model!r}")
            args.model = args.model_tag
        return run_server(args)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    try:
        engine_args = EngineArgs.from_cli_args(args)
        llm = LLM(**vars(engine_args))
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens)
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    if args.journey:
        print(format_journey(llm.engine.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
