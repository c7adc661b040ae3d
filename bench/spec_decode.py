"""Speculative decoding on the embedded target/draft pair: acceptance and speed-up, batch 1 and 16, k = 2..6.

Prompts are openings of held-out stories from the project's own corpus generator, so the draft has seen this
kind of text (as a real draft model would have). Greedy, so outputs must equal the plain run's exactly.

    python bench/spec_decode.py [--batch-sizes 1,16] [--ks 2,3,4,5,6] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "data"))
from corpus import HELDOUT_SEED, generate_corpus  # noqa: E402


def prompts(n: int) -> list[str]:
    return [" ".join(story.split()[:6]) for story in generate_corpus(n, seed=HELDOUT_SEED)]


def timed(llm: LLM, batch: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.generate(batch[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_MODEL))
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--ks", default="2,3,4,5,6")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, torch {torch.__version__}, greedy, {args.max_tokens} output tokens per request")
    print(f"{'batch':>5} {'drafter':>8} {'k':>2} {'tok/s':>8} {'accept':>7} {'mean len':>8} {'speed-up':>8}")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        batch = prompts(bs)
        base_s, base_tokens = timed(LLM(args.model, trace_steps=0), batch, params)
        total = sum(len(t) for t in base_tokens)
        print(f"{bs:5d} {'none':>8} {'-':>2} {total / base_s:8.1f} {'-':>7} {'1.00':>8} {'1.00x':>8}")
        for drafter in (args.draft, "[ngram]"):
            for k in [int(k) for k in args.ks.split(",")]:
                llm = LLM(args.model, speculative_model=drafter, num_speculative_tokens=k, trace_steps=0)
                secs, tokens = timed(llm, batch, params)
                assert tokens == base_tokens, "speculative greedy output must equal plain greedy output"
                st = llm.engine.stats()
                name = "draft" if drafter == args.draft else "ngram"
                print(f"{bs:5d} {name:>8} {k:2d} {total / secs:8.1f} {st['spec_acceptance_rate']:7.1%} "
                      f"{st['spec_mean_accepted_length']:8.2f} {base_s / secs:7.2f}x")


if __name__ == "__main__":
    main()
