"""Running one model on several processes: rank 0 is the engine's own process, the others workers.

    workers.py   rank 0 starts ranks 1..N-1 (torch.multiprocessing spawn), watches them, stops them
    worker.py    what a worker process runs: build its shard, then execute every step rank 0 sends
    driver.py    rank 0's ModelRunner: sends each step's SchedulerOutput to the workers, then runs
                 its own shard; between steps it can ask each worker for its state (rank_states)

The scheduler, the block pool and the output side exist only on rank 0: every rank holds the same
block ids for its own KV heads. (vLLM's name for this layer is the executor, too.)
"""
