"""CPU-side bookkeeping: block pool, KV-cache manager, scheduler (plain Python, no torch)."""
