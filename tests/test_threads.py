"""One LLM shared by many threads: their generate calls join one running batch, aborts and failures reach the
right callers, and nothing hangs (every join is bounded, so a hang fails the test instead of blocking the run)."""

import threading
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.step_driver import StepDriver
from minivllm.sampling_params import RequestOutputKind

JOIN_TIMEOUT = 120  # seconds for all threads of one test, on a loaded 2-core machine


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, max_num_seqs=16)


def run_threads(targets: list, stagger: float = 0.0) -> None:
    """Start one thread per target, `stagger` seconds apart; fail (not hang) if any is still running at the end."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    deadline = time.monotonic() + JOIN_TIMEOUT
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.1))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"threads {stuck} still running after {JOIN_TIMEOUT}s: a hang"


class Scheduled:
    """A step observer: the request ids each step scheduled; `seen` is set once any request has run."""

    def __init__(self) -> None:
        self.steps: list[set[str]] = []
        self.seen = threading.Event()

    def __call__(self, engine, record) -> None:
        ids = {s.request_id for s in record.scheduler_output.scheduled}
        self.steps.append(ids)
        if ids:
            self.seen.set()


def test_ten_staggered_threads_share_one_batch(llm):
    """The material's example: 10 threads, staggered starts, mixed lengths, one shared LLM."""
    prompts = [f"Request {i}: once upon a time" for i in range(10)]
    lengths = [48, 4, 20, 9, 33, 2, 15, 40, 6, 25]
    expected = [o.outputs[0].token_ids for o in llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    seen = Scheduled()
    llm.engine.add_step_observer(seen)

    def worker(i: int):
        def go():
            try:
                params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
                results[i] = llm.generate([prompts[i]], params, use_tqdm=False)
            except BaseException as e:
                errors.append(e)
        return go

    try:
        run_threads([worker(i) for i in range(10)], stagger=0.01)
    finally:
        llm.engine.remove_step_observer(seen)
    assert not errors, errors
    assert sorted(results) == list(range(10))
    for i, outs in results.items():
        assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "length"
        assert outs[0].outputs[0].token_ids == expected[i], f"thread {i}: batching with others changed its tokens"
    owner = {outs[0].request_id: i for i, outs in results.items()}
    threads_per_step = [len({owner[r] for r in ids if r in owner}) for ids in seen.steps]
    assert max(threads_per_step) >= 4, f"the threads' requests were not batched together: {threads_per_step}"
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.stats()["num_total_blocks"]
    assert not llm.engine.has_unfinished_requests()


def test_abort_from_another_thread(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def call(name, prompts, params):
        def go():
            try:
                results[name] = llm.generate(prompts, params, use_tqdm=False)
            except BaseException as e:
                errors.append(e)
        return go

    watch = Scheduled()
    llm.engine.add_step_observer(watch)
    try:
        long_thread = threading.Thread(target=call("long", ["A long story:"], long), daemon=True)
        long_thread.start()
        assert watch.seen.wait(JOIN_TIMEOUT), "the long request never ran"
        (first_id,) = watch.steps[0]  # another thread learns the running request's id (here from the trace)
        others = [call(f"short{i}", [f"Short {i}", f"Shorter {i}"], short) for i in range(8)]
        aborter = lambda: (time.sleep(0.05), llm.abort_request(first_id))  # noqa: E731
        run_threads([*others, aborter], stagger=0.005)
        long_thread.join(JOIN_TIMEOUT)
        assert not long_thread.is_alive(), "the aborted call never returned"
    finally:
        llm.engine.remove_step_observer(watch)
    assert not errors, errors
    aborted = results["long"][0]
    assert aborted.request_id == first_id and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort" and len(aborted.outputs[0].token_ids) < 200
    for i in range(8):
        assert [o.outputs[0].finish_reason for o in results[f"short{i}"]] == ["length", "length"]
        assert all(len(o.outputs[0].token_ids) == 8 for o in results[f"short{i}"])
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.engine.has_unfinished_requests()


def test_bad_input_fails_only_its_own_call(llm):
    ok: list = []
    errors: dict[int, BaseException] = {}

    def worker(i):
        def go():
            prompt = {"prompt_token_ids": [10**9]} if i == 3 else f"Prompt {i}"  # 3: a token id out of range
            try:
                ok.append(llm.generate([prompt, "and another"], SamplingParams(max_tokens=5), use_tqdm=False))
            except BaseException as e:
                errors[i] = e
        return go

    run_threads([worker(i) for i in range(8)], stagger=0.005)
    assert list(errors) == [3] and isinstance(errors[3], ValueError), errors
    assert len(ok) == 7 and all(o.finished for outs in ok for o in outs)
    assert not llm.engine.has_unfinished_requests()  # the bad call's good prompt never went in


def test_a_failing_step_reaches_every_waiting_caller(llm):
    """An exception inside a step (here from a step observer) must end every call in flight, not hang them."""
    started = threading.Barrier(9, timeout=JOIN_TIMEOUT)
    errors: dict[int, BaseException] = {}

    class Boom(Exception):
        pass

    def explode(engine, record):
        if len(engine.scheduler.running) == 8:  # every thread's request is in the batch
            raise Boom("step observer failed")

    def worker(i):
        def go():
            started.wait()
            try:
                llm.generate([f"Thread {i} says"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                             use_tqdm=False)
            except BaseException as e:
                errors[i] = e
        return go

    llm.engine.add_step_observer(explode)
    try:
        run_threads([worker(i) for i in range(8)] + [lambda: started.wait()], stagger=0.0)
    finally:
        llm.engine.remove_step_observer(explode)
    assert sorted(errors) == list(range(8)), f"calls that did not hear of the failure: {set(range(8)) - set(errors)}"
    direct = [e for e in errors.values() if isinstance(e, Boom)]
    relayed = [e for e in errors.values() if not isinstance(e, Boom)]
    assert len(direct) >= 1, "the driving thread gets the step's own exception"
    assert all(isinstance(e, RuntimeError) and isinstance(e.__cause__, Boom) for e in relayed), relayed
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "the failed calls' blocks were not given back"
    again = llm.generate(["After the failure"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 4  # the LLM still works


def test_a_caller_interrupted_while_waiting_takes_out_only_its_own_requests(llm):
    """Ctrl-C in one waiting thread (here: its progress callback raises) withdraws that call's requests; the
    thread driving carries on, and the withdrawn requests give their blocks back."""
    driver = StepDriver(llm.engine)  # used only by this test's threads
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    results, errors = {}, {}
    watch = Scheduled()

    class Interrupt(BaseException):
        pass

    def impatient(finished: int) -> None:
        raise Interrupt

    def call(name, ids, progress=None):
        def go():
            try:
                results[name] = driver.run(ids, ["Hello"] * len(ids), [params] * len(ids), [0] * len(ids), progress)
            except BaseException as e:
                errors[name] = e
        return go

    llm.engine.add_step_observer(watch)
    try:
        patient = threading.Thread(target=call("patient", ["p0", "p1"]), daemon=True)
        patient.start()
        assert watch.seen.wait(JOIN_TIMEOUT)
        run_threads([call("impatient", ["i0", "i1", "i2"], impatient)])
        patient.join(JOIN_TIMEOUT)
        assert not patient.is_alive()
    finally:
        llm.engine.remove_step_observer(watch)
    assert list(errors) == ["impatient"] and isinstance(errors["impatient"], Interrupt)
    assert [len(o.outputs[0].token_ids) for o in results["patient"]] == [60, 60]
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests() and stats["num_free_blocks"] == stats["num_total_blocks"]
