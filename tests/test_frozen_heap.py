"""LLM.generate keeps the heap frozen while its steps run (full collections skip what was alive before)
and gives it back afterwards: nothing stays hidden from the collector, a caller's own freeze is left alone."""

import gc
import weakref

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.frozen_heap import frozen_heap


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64, max_num_seqs=4)


class Cycle:
    """A reference cycle: only the collector, never reference counting, frees it."""

    def __init__(self) -> None:
        self.me = self


def frozen_counts_during(llm: LLM) -> list[int]:
    """gc.get_freeze_count() as each step of one generate call saw it."""
    counts: list[int] = []
    observer = lambda engine, record: counts.append(gc.get_freeze_count())  # noqa: E731
    llm.engine.add_step_observer(observer)
    try:
        llm.generate(["Hello there", "Once upon a time"], SamplingParams(temperature=0, max_tokens=8))
    finally:
        llm.engine.remove_step_observer(observer)
    return counts


def test_steps_run_on_a_frozen_heap_which_is_given_back(llm):
    assert gc.get_freeze_count() == 0  # pytest froze nothing: the check below would mean nothing
    counts = frozen_counts_during(llm)
    assert len(counts) >= 8 and all(c > 1000 for c in counts), counts  # the model and libraries, at least
    assert gc.get_freeze_count() == 0


def test_garbage_frozen_with_the_rest_is_collected_afterwards(llm):
    cycle = Cycle()
    ref = weakref.ref(cycle)
    del cycle  # garbage now, but only a collection can tell; generate freezes it with everything else
    assert frozen_counts_during(llm)
    gc.collect()
    assert ref() is None


def test_a_callers_own_freeze_is_left_alone(llm):
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        frozen_counts_during(llm)
        assert before > 1000 and gc.get_freeze_count() > 0  # generate's unfreeze would have emptied it
    finally:
        gc.unfreeze()


def test_frozen_heap_gives_back_on_error():
    with pytest.raises(RuntimeError), frozen_heap():
        assert gc.get_freeze_count() > 0
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0
