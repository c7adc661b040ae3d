"""Command line: `python -m minivllm generate "Hi, my name is" --max-tokens 32`, or `python -m minivllm serve`."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine knobs both subcommands share (names as in vLLM's CLI)."""
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--speculative-model", default=None, help='a draft checkpoint directory, or "[ngram]"')
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    parser.add_argument("--swap-space", type=float, default=4, help="GiB of host memory for swapped KV blocks")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many processes (gloo on CPU, NCCL on GPUs)")
    # quantization (issue 24): --model also takes a .gguf file
    parser.add_argument("--quantization", "-q", default=None,
                        help="int8 (weight-only, from a float checkpoint), or gptq/awq/gguf to insist on the "
                             "checkpoint's own format (default: as the checkpoint is)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                num_kv_blocks=args.num_kv_blocks, attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager,
                speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens,
                scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
                swap_space=args.swap_space, quantization=args.quantization,
                tensor_parallel_size=args.tensor_parallel_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--journey", action="store_true", help="print what each engine step did")
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the name clients use (default: the directory's)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="json: one JSON object per log record (request events carry the request id)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $VLLM_API_KEY)")
    srv.add_argument("--allowed-origins", default="", help="comma-separated CORS origins, or '*' (default: none)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get after SIGTERM before they are aborted")
    srv.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    srv.add_argument("--max-n", type=int, default=128, help="the largest n a request may ask for")
    srv.add_argument("--max-tokens-times-n", type=int, default=2**17,
                     help="the most output tokens one request may ask for: max_tokens x n x prompts")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams
    from minivllm.engine.journey import format_journey

    try:
        llm = LLM(args.model, **engine_kwargs(args))
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


def _serve(args: argparse.Namespace) -> int:
    try:
        from minivllm.server import serve
    except ImportError as e:
        print(f"error: {e}; install the server extra: pip install 'minivllm[serve]'", file=sys.stderr)
        return 2
    try:
        from minivllm.server.limits import ServerLimits

        limits = ServerLimits(args.max_request_bytes, min(args.max_n, 128), args.max_tokens_times_n)
        origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
        serve(args.model, host=args.host, port=args.port, model_name=args.served_model_name,
              log_level=args.log_level, log_format=args.log_format, api_key=args.api_key, allowed_origins=origins,
              shutdown_timeout=args.shutdown_timeout, limits=limits, **engine_kwargs(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads; once serving, it is a clean shutdown
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
