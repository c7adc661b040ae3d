"""Decode of the embedded mixture of experts: minivllm against transformers, and the expert bytes a step reads.

For each batch size (1 and 64 by default) both engines generate the same greedy continuations of the same
prompts from the same checkpoint (`minivllm-tiny-moe`, 8 experts, 2 per token, unless --model says otherwise):

* decode tokens/s. minivllm: decode tokens over the wall time of the steps that only decoded (from the engine's
  trace). transformers: `generate` for N new tokens minus `generate` for 1 (its prefill and first token), both
  timed after a warm-up, so the difference is N - 1 decode steps.
* expert weight bytes read per decode step: each MoE layer reads every expert that at least one token of the
  step chose, once (the trace's tokens per expert per layer per step, counted as distinct experts), against
  all the experts the model holds; next to it what uniform routing would touch, E (1 - (1 - k/E)^B) per layer.

Timings want a quiet machine; `--smoke` runs a few tokens only, to check the script still works.

    python bench/moe_decode.py [--model PATH] [--batches 1 64] [--new-tokens 64] [--device cpu] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.config import DEFAULT_MOE_MODEL
from minivllm.widgets.experts import expert_bytes_read, experts_touched

PROMPTS = ["Hi, my name is", "Today is a beautiful summer day", "Hello there", "Once upon a time",
           "The little dog", "What color is the sky?", "Tom and his mom went to", "One day, a bird"]


def prompts_for(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def expert_shapes(llm: LLM) -> tuple[int, int, int, int]:
    """(MoE layers, experts per layer, experts per token, bytes of one expert) from the loaded model."""
    from minivllm.model.moe_layer import MoeFeedForward

    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoeFeedForward)]
    if not layers:
        raise SystemExit("this model has no mixture-of-experts layer")
    experts = layers[0].experts
    one = (experts.gate_up_proj[0].numel() * experts.gate_up_proj.element_size()
           + experts.down_proj[0].numel() * experts.down_proj.element_size())
    return len(layers), layers[0].num_experts, layers[0].top_k, one


def minivllm_decode(llm: LLM, batch: int, new_tokens: int) -> tuple[float, list[list[list[int]]]]:
    """(decode tokens/s, each decode-only step's expert load [layer][expert]) for one batch."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts_for(batch), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    first = llm.engine.stats()["num_steps"]
    llm.generate(prompts_for(batch), params, use_tqdm=False)
    steps = [t for t in llm.engine.trace if t.step >= first and t.scheduled
             and all(e.kind == "decode" for e in t.scheduled)]
    tokens = sum(len(t.scheduled) for t in steps)
    seconds = sum(t.duration_s for t in steps)
    return tokens / seconds, [list(map(list, t.expert_load)) for t in steps if t.expert_load]


@torch.inference_mode()
def transformers_decode(model, tok, batch: int, new_tokens: int) -> float:
    """Decode tokens/s of `generate` (greedy, left-padded batch, KV cache on)."""
    tok.padding_side = "left"
    enc = tok(prompts_for(batch), return_tensors="pt", padding=True)

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return batch * (new_tokens - 1) / max(1e-9, timed(new_tokens) - timed(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MOE_MODEL))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="8 new tokens: checks the script, times nothing")
    args = ap.parse_args()
    new_tokens = 8 if args.smoke else args.new_tokens
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(args.model, device=args.device, dtype="float32", trace_steps=10_000, max_num_seqs=max(args.batches))
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    num_layers, num_experts, top_k, per_expert = expert_shapes(llm)
    total = num_layers * num_experts * per_expert
    print(f"{args.model}: {num_layers} MoE layers x {num_experts} experts, {top_k} per token; one expert "
          f"{per_expert:,} B, all experts {total:,} B (float32), device {args.device}, torch threads "
          f"{torch.get_num_threads()}, {new_tokens} new tokens{' (smoke run: no figures)' if args.smoke else ''}")
    print(f"{'batch':>5} {'minivllm tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'experts/layer':>14} {'uniform':>8} {'expert B read/step':>19} {'of all':>7}")
    for batch in args.batches:
        ours, loads = minivllm_decode(llm, batch, new_tokens)
        theirs = transformers_decode(hf, tok, batch, new_tokens)
        touched = statistics.mean(statistics.mean(experts_touched(load)) for load in loads)
        read = statistics.mean(expert_bytes_read(load, per_expert) for load in loads)
        uniform = num_experts * (1 - (1 - top_k / num_experts) ** batch)
        print(f"{batch:5d} {ours:15.1f} {theirs:19.1f} {ours / theirs:6.2f} {touched:14.2f} {uniform:8.2f} "
              f"{read:19,.0f} {read / total:7.1%}")


if __name__ == "__main__":
    main()
