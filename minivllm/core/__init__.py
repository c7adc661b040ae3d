"""CPU-side bookkeeping: the block pool, the KV-cache manager and the scheduler (plain Python, no
torch)."""
