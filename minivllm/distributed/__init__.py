"""Tensor parallelism's process group and collectives, on torch.distributed (gloo on CPU, NCCL on
CUDA).

    parallel.py  one rank's TensorParallel (rank, size, its process groups), the collectives
                 layers call and the tally of what they carried (CollectiveTraffic)
    cleanup.py   vLLM's cleanup_dist_env_and_memory, which examples call between two LLMs

This sits at the bottom of the house, beside core: the model's layers shard themselves through it,
as vLLM's layers use `vllm.distributed`. Starting and watching the worker processes is the
executor's job (minivllm/executor/).
"""

# vLLM's name, which its examples call
from minivllm.distributed.cleanup import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
