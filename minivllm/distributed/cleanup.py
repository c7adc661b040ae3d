"""vLLM's `vllm.distributed.cleanup_dist_env_and_memory`, which examples call between two LLMs.

An engine's worker processes (tensor parallelism) stop with the engine itself (`LLMEngine.shutdown`,
or when it is collected), so what is left to clean up is returning memory: Python objects no longer
referenced (the deleted LLM's weights and KV cache) and, on CUDA, the allocator's cached blocks, so
the next LLM's memory profile starts from what is really in use.
"""

from __future__ import annotations

import gc

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Collect garbage and empty the CUDA cache (`shutdown_ray`: vLLM's signature; no Ray here)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
