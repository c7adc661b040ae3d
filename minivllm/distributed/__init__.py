"""Tensor parallelism's process groups and collectives on torch.distributed (gloo CPU, NCCL CUDA).

parallel.py holds one rank's TensorParallel: its process groups, the collectives layers call and
the tally of what they carried. This sits at the bottom of the house, beside core: the model's
layers shard themselves through it, as vLLM's use `vllm.distributed`; starting and watching the
worker processes is the executor's job (minivllm/executor/).
"""

from __future__ import annotations

import gc

import torch

__all__ = ["cleanup_dist_env_and_memory"]


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's, which examples call between two LLMs. Worker processes stop with their engine, so
    what is left is memory: collect the deleted LLM's objects and empty CUDA's cached blocks, so the
    next LLM's memory profile starts from what is really in use (`shutdown_ray`: no Ray here)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
