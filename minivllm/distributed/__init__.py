"""Tensor parallelism on torch.distributed: one model split across processes (gloo on CPU, NCCL on CUDA).

    parallel.py  one rank's TensorParallel (rank, size, its process groups), the collectives layers call and
                 the tally of what they carried (CollectiveTraffic)
    workers.py   rank 0 starts ranks 1..N-1 (torch.multiprocessing spawn), watches them, stops them
    worker.py    what a worker process runs: build its shard, then execute every step rank 0 sends
    driver.py    rank 0's ModelRunner: sends each step's SchedulerOutput to the workers, then runs its own shard;
                 between steps it can ask each worker for its per-sequence state (rank_states)
    cleanup.py   vLLM's cleanup_dist_env_and_memory, which examples call between two LLMs in one script

Rank 0 is the engine's own process: the scheduler, the block pool and the output side exist only there.
"""

from minivllm.distributed.cleanup import cleanup_dist_env_and_memory  # vLLM's name, which its examples call

__all__ = ["cleanup_dist_env_and_memory"]
