"""Tensor parallelism's process groups and collectives on torch.distributed (gloo CPU, NCCL CUDA).

    parallel.py  one rank's TensorParallel (rank, size, its process groups), the collectives
                 layers call and the tally of what they carried (CollectiveTraffic)
    cleanup.py   vLLM's cleanup_dist_env_and_memory, which examples call between two LLMs

This sits at the bottom of the house, beside core: the model's layers shard themselves through it,
as vLLM's layers use `vllm.distributed`. Starting and watching the worker processes is the
executor's job (minivllm/executor/).
"""

from minivllm.distributed.cleanup import cleanup_dist_env_and_memory  # vLLM's, examples call it

__all__ = ["cleanup_dist_env_and_memory"]
