"""Running one model on several processes (vLLM's executor): workers.py starts, watches and stops
child processes (tensor-parallel ranks 1..N-1, or data-parallel engines), worker.py is what a rank
runs, driver.py is rank 0's ModelRunner, which sends each step to them. The scheduler, the block
pool and the output side exist only on rank 0: every rank holds the same block ids for its own KV
heads.
"""
