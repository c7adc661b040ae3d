"""Shared pieces of the benchmarks: the workload generator and a fair transformers baseline."""

from __future__ import annotations

import random
import time

import torch


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs, lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


@torch.inference_mode()
def transformers_throughput(model, workload, batch_size: int, pad_id: int = 0,
                            temperature: float = 0.0) -> tuple[float, float]:
    """Static batching, as `generate` does it: left-pad each batch and run it to its longest output.

    Returns (useful output tokens per second, seconds). Only the tokens each request asked for count;
    the extra steps a batch spends waiting for its longest member are the cost of static batching.
    temperature > 0 samples with no other filter (transformers' default top_k=50 is switched off).
    """
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(
        do_sample=False)
    device = next(model.parameters()).device
    useful, start = 0, time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        new = max(n for _, n in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=pad_id, **sampling)
        useful += sum(n for _, n in batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return useful / seconds, seconds
