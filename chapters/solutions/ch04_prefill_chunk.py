"""Reference solution, chapter 04: how much of a waiting prompt fits in the step's token budget."""


def my_prefill_chunk(num_remaining: int, budget: int, enable_chunked_prefill: bool) -> int:
    if num_remaining <= budget:
        return num_remaining  # it all fits
    return budget if enable_chunked_prefill else 0  # a chunk now, the rest later; or wait for room
