"""Command line: `python -m minivllm generate "Hi, my name is" --max-tokens 32`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--journey", action="store_true", help="print what each engine step did")
    args = parser.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.engine.journey import format_journey

    try:
        llm = LLM(args.model, device=args.device)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
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
