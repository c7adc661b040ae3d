"""Prefix caching: 32 requests sharing a 512-token system prompt, each with its own 32-token question.

Measures prefill tokens computed and time to first token with automatic prefix caching on and off, on the
same model in one run. A first request warms the cache, as the first user of a deployed system prompt would.
Target (issue 5): at least 90% fewer prefill tokens computed.

    python bench/prefix_caching.py [--model PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minivllm import LLM, SamplingParams
from minivllm.config import DEFAULT_MODEL
from minivllm.model import read_model_config


def run(model: str, caching: bool, system: list[int], questions: list[list[int]], max_tokens: int) -> dict:
    llm = LLM(model, enable_prefix_caching=caching, trace_steps=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": system + questions[0]}], params, use_tqdm=False)  # warm-up user
    before = llm.engine.stats()["num_prefill_tokens_computed"]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": system + q} for q in questions[1:]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.time_to_first_token for o in outs]
    stats = llm.engine.stats()
    return {"prefill": stats["num_prefill_tokens_computed"] - before, "seconds": seconds,
            "ttft_mean": statistics.mean(ttft), "ttft_p50": statistics.median(ttft), "ttft_max": max(ttft),
            "hit_rate": stats["prefix_cache_hit_rate"], "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    vocab = read_model_config(args.model).vocab_size
    rng = random.Random(0)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    questions = [[rng.randrange(10, vocab) for _ in range(args.question_tokens)] for _ in range(args.requests + 1)]
    off = run(args.model, False, system, questions, args.max_tokens)
    on = run(args.model, True, system, questions, args.max_tokens)
    assert on["tokens"] == off["tokens"], "prefix caching must not change the output"
    print(f"{args.requests} requests: {args.system_tokens}-token shared system prompt + "
          f"{args.question_tokens}-token question each, {args.max_tokens} output tokens, after one warm-up request")
    for name, r in (("caching off", off), ("caching on ", on)):
        print(f"{name}: prefill tokens computed {r['prefill']:6d}   TTFT mean {r['ttft_mean'] * 1e3:7.1f} ms  "
              f"p50 {r['ttft_p50'] * 1e3:7.1f} ms  max {r['ttft_max'] * 1e3:7.1f} ms   total {r['seconds']:.2f} s")
    print(f"prefill tokens saved: {1 - on['prefill'] / off['prefill']:.1%} (target >= 90%); "
          f"hit rate {on['hit_rate']:.1%}; TTFT mean speed-up {off['ttft_mean'] / on['ttft_mean']:.2f}x; "
          f"outputs identical: yes")


if __name__ == "__main__":
    main()
