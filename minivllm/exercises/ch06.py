"""Chapter 06 exercise: `hash_block`, the chained name prefix caching looks full blocks up by.

The checker tries the function alone (the properties a chained name needs), then runs the engine
with it on prompts built to trip a name that forgets its parent: the second prompt is the first
shifted by one block, so its first block holds the first prompt's second block's tokens, elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.exercises.common import check_greedy_matches_transformers, generate
from minivllm.exercises.report import ExerciseFailure, Report, run_checks
from minivllm.hooks import EngineHooks


def _check_hits_and_equality(hooks: EngineHooks, block_size: int) -> None:
    """The engine with it: shared prefixes are found, and the tokens still match transformers."""
    rng = list(range(40, 40 + 5 * block_size))
    shifted = rng[block_size:] + [7] * block_size  # its first block = the first prompt's second
    prompts = [rng, shifted, rng[: 3 * block_size] + [11, 12, 13]]  # the third shares 3 blocks
    check_greedy_matches_transformers(hooks, f"prefix caching, blocks of {block_size} tokens "
                                      f"and a prompt that is another shifted by one block",
                                      prompts, max_tokens=8, block_size=block_size,
                                      num_kv_blocks=64, max_num_seqs=1)
    _, _, llm = generate(hooks, prompts, 4, block_size=block_size, num_kv_blocks=64,
                         max_num_seqs=1)
    if llm.engine.stats()["prefix_cache_hits"] < 3 * block_size:
        raise ExerciseFailure(f"the third prompt shares its first 3 full blocks with the "
                              f"first, but only {llm.engine.stats()['prefix_cache_hits']} "
                              f"prompt tokens were found in the prefix cache (expected at "
                              f"least {3 * block_size}).")


def check_hash_block(hash_block: Callable, block_size: int = 4) -> Report:
    """Grade `hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes`."""
    hooks = EngineHooks(hash_block=hash_block)

    def deterministic_bytes():
        a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 4])
        if not isinstance(a, bytes):
            raise ExerciseFailure(f"hash_block returned a {type(a).__name__}; it must return bytes "
                                  f"(e.g. a SHA-256 digest), the type the pool's cache is keyed "
                                  f"by.")
        if a != b:
            raise ExerciseFailure("hashing the same tokens after the same parent twice gave two "
                                  "different names: a later request could never find the block "
                                  "again.")

    def tokens_matter():
        pairs = [([1, 2, 3, 4], [1, 2, 3, 5]), ([1, 2, 3, 4], [4, 3, 2, 1]),
                 ([1, 23, 4, 5], [12, 3, 4, 5])]
        for x, y in pairs:
            if hash_block(None, x) == hash_block(None, y):
                raise ExerciseFailure(f"blocks {x} and {y} got the same name: a request with one "
                                      f"would read the K/V of the other. (Joining ids as text "
                                      f"without a separator makes [1, 23] and [12, 3] the same "
                                      f"string.)")

    def parent_matters():
        first, other = hash_block(None, [1, 2, 3, 4]), hash_block(None, [9, 9, 9, 9])
        if hash_block(first, [5, 6, 7, 8]) == hash_block(other, [5, 6, 7, 8]):
            raise ExerciseFailure("the block [5, 6, 7, 8] got the same name after two different "
                                  "first blocks: the name must depend on the parent's name too, so "
                                  "that a block is shared only when everything before it is the "
                                  "same.")
        if hash_block(first, [5, 6, 7, 8]) == hash_block(None, [5, 6, 7, 8]):
            raise ExerciseFailure("the block [5, 6, 7, 8] got the same name as the first block of "
                                  "a prompt and as the second block after [1, 2, 3, 4]: its K/V "
                                  "differ (other positions).")

    return run_checks("ch06 hash_block", [
        ("the name is bytes, and the same for the same block", deterministic_bytes),
        ("different tokens give different names", tokens_matter),
        ("the name depends on the parent (the chain)", parent_matters),
        ("the engine finds shared prefixes and still matches transformers",
         lambda: _check_hits_and_equality(hooks, block_size))])
