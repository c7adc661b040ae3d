"""StepDriver: many threads share one LLMEngine, and whichever thread is waiting drives it.

LLMEngine is not thread-safe (add, abort and step all touch the scheduler and the block pool): two
threads stepping it at once corrupt it (ten threads sharing one `LLM` used to hang). So the engine
has one driver at a time. A thread that calls `run` queues its requests and waits; when nobody is
driving, it becomes the driver: it adds everything queued since the last step (its own requests and
other threads'), takes one step, hands each finished output to the thread that asked for it, and
repeats until its own requests are done, then hands the role on. Requests queued while a step runs
go in right before the next one, so concurrent calls share one running batch: continuous batching
across threads. (vLLM's `LLM` is not thread-safe; its server's AsyncEngine has one asyncio task
drive.)

Failures reach everyone who waits: an exception from a step fails every call in flight (the driver's
caller gets it, the others a RuntimeError chained to it) and their requests are aborted; a call
interrupted in its own thread (KeyboardInterrupt) takes only its own requests out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from minivllm.engine.frozen_heap import frozen_heap
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class StepFailedError(RuntimeError):
    """The step another thread was driving raised; `__cause__` is its exception."""


@dataclass
class _Call:
    """One `run`: its requests, and the finished outputs routed back to it."""

    request_ids: list[str]
    prompts: list[PromptType]
    params: list[SamplingParams]
    priorities: list[int]
    results: list[RequestOutput | None] = field(init=False)
    remaining: int = field(init=False)
    error: BaseException | None = None
    in_engine: bool = False  # added (so aborting it means aborting its requests)
    withdrawn: bool = False

    def __post_init__(self) -> None:
        self.results, self.remaining = [None] * len(self.request_ids), len(self.request_ids)

    @property
    def done(self) -> bool:
        return self.error is not None or self.remaining == 0 or self.withdrawn


class StepDriver:
    """Run batches of requests from any number of threads through one engine, one step at a time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()  # guards everything below; never held during a step
        self._driving = False
        self._adds: list[_Call] = []  # queued, not yet in the engine
        self._aborts: list[str] = []
        self._owner: dict[str, tuple[_Call, int]] = {}  # request id -> its call and index there

    def run(self, request_ids: Sequence[str], prompts: Sequence[PromptType],
            params: Sequence[SamplingParams], priorities: Sequence[int],
            progress: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Add the requests (all or none: a ValueError says why), wait or drive until all have
        finished, and return their final outputs in order. `progress(n)` hears, in this thread, how
        many have finished."""
        call = _Call(list(request_ids), list(prompts), list(params), list(priorities))
        if not call.request_ids:
            return []
        with self._cond:
            self._adds.append(call)
        try:
            while True:
                with self._cond:
                    while self._driving and not call.done:
                        self._cond.wait()
                        if progress is not None:
                            progress(len(call.request_ids) - call.remaining)
                    if call.done:
                        break
                    self._driving = True
                try:
                    with frozen_heap():  # no full collection walks the model mid-step
                        self._drive(call, progress)
                finally:
                    self._release()
        except BaseException:  # interrupted here (KeyboardInterrupt): nobody will collect them
            self._withdraw(call)
            raise
        if call.error is not None:
            raise call.error
        return call.results

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests from any thread: before the next step if one is being driven, else right
        away. Their callers get them back finished with finish_reason "abort"."""
        with self._cond:
            self._aborts.extend(request_ids)
            if self._driving:
                return
            self._driving = True
        try:
            # a request still queued goes in first, so that it can be aborted
            self._apply_queued(add=True)
        finally:
            self._release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[LLMEngine]:
        """Hold the engine alone (once the current driver hands it over), for work that is not a
        batch of requests: beam search, resetting the prefix cache. Queued aborts go first."""
        with self._cond:
            while self._driving:
                self._cond.wait()
            self._driving = True
        try:
            self._apply_queued(add=False)
            yield self.engine
        finally:
            self._release()

    # ---- the driver ------------------------------------------------------------------------------
    def _drive(self, call: _Call, progress: Callable[[int], None] | None) -> None:
        while not call.done:
            try:
                self._apply_queued(add=True)
                if not self.engine.has_unfinished_requests() and not call.done:
                    raise RuntimeError("the engine has no requests left but a call is still "
                                       "waiting for outputs (were its requests aborted directly on "
                                       "llm.engine?)")
                outputs = self.engine.step()
            except Exception as e:  # the engine's state is unknown: fail everyone, not hang them
                self._fail_all(e, call)
                return
            with self._cond:
                for out in outputs:
                    if out.finished and out.request_id in self._owner:
                        owner, index = self._owner.pop(out.request_id)
                        owner.results[index] = out
                        owner.remaining -= 1
                self._cond.notify_all()
            if progress is not None:
                progress(len(call.request_ids) - call.remaining)

    def _apply_queued(self, add: bool) -> None:
        """In the driver: add the queued calls (add=True), each all-or-nothing, then apply the
        queued aborts (after the adds, so an abort that overtook its request still finds it)."""
        with self._cond:
            adds, self._adds = (self._adds, []) if add else ([], self._adds)
        while adds:
            call = adds[0]
            try:
                batch = [self.engine.process_request(rid, p, sp, priority=pr)
                         for rid, p, sp, pr in zip(call.request_ids, call.prompts, call.params,
                                                   call.priorities)]
            except Exception as e:  # bad input fails its own call only
                with self._cond:
                    call.error = e
                    self._cond.notify_all()
                adds.pop(0)
                continue
            except BaseException:  # interrupted (Ctrl-C): the calls not yet in go back to the queue
                with self._cond:
                    self._adds[:0] = adds
                raise
            for request in batch:
                self.engine.enqueue(request)
            with self._cond:
                call.in_engine = True
                for i, rid in enumerate(call.request_ids):
                    self._owner[rid] = (call, i)
                if call.withdrawn:  # its thread gave up while it was being added
                    self._aborts.extend(call.request_ids)
            adds.pop(0)
        with self._cond:
            aborts, self._aborts = self._aborts, []
        if aborts:
            self.engine.abort_request(aborts)

    def _fail_all(self, exc: Exception, driver_call: _Call) -> None:
        with self._cond:
            calls = {id(c): c for c, _ in self._owner.values()} | {id(c): c for c in self._adds}
            calls[id(driver_call)] = driver_call
            in_engine, self._adds = list(self._owner), []
            self._owner.clear()
            for c in calls.values():
                if c.error is not None or not c.remaining:
                    continue
                if c is driver_call:
                    c.error = exc
                else:
                    c.error = StepFailedError(f"the engine step driven by another thread failed: "
                                              f"{exc!r}")
                    c.error.__cause__ = exc
            self._cond.notify_all()
        with contextlib.suppress(Exception):  # best effort: give their blocks back
            self.engine.abort_request(in_engine)

    def _withdraw(self, call: _Call) -> None:
        with self._cond:
            call.withdrawn = True
            if call in self._adds:
                self._adds.remove(call)
            elif call.in_engine:
                unfinished = [rid for rid in call.request_ids
                              if self._owner.get(rid, (None,))[0] is call]
                for rid in unfinished:
                    del self._owner[rid]
                self._aborts.extend(unfinished)

    def _release(self) -> None:
        with self._cond:
            self._driving = False
            self._cond.notify_all()
