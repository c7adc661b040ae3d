"""vLLM's v1 logits-processor interface: batch-level processors keeping per-row state across steps.

The engine builds one instance per class at start-up, tells it before each sampling step how the
batch changed (`update_state(BatchUpdate)`), then hands it the logits (`apply`). State is kept per
row, never per request id, so processors can keep tensors indexed like the batch; requests opt in
through `SamplingParams.extra_args`. Row bookkeeping is persistent_batch.py's job."""

from __future__ import annotations

import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

T = TypeVar("T")


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at index a now sits at b (a is empty afterwards)
    SWAP = enum.auto()  # the requests at a and b trade places


RemovedRequest = int  # the row index that left
# (index, params, prompt ids, output ids)
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]
# a request-level processor: ([prompt_ids,] output_ids, logits_row) -> logits_row
RequestLogitsProcessor = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step; apply in this order: removed, added, moved.
    `output_tok_ids` in `added` is the request's live output list: it grows as tokens are sampled,
    so a processor that keeps the reference always sees the latest tokens without being told."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1). Subclasses implement the four methods below."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError when a request's params (its extra_args, say) are invalid for this
        processor; called when the request arrives, so a bad request fails alone before any work."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: EngineConfig, device: torch.device,
                 is_pin_memory: bool) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process [batch_size, vocab] float32 logits (row i = request i); may work in place."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit (min_p, say): then
        skipped when every row is greedy."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every apply(); `batch_update` is None when the batch did not change."""


class BatchUpdateBuilder:
    """One step's changes, frozen into a BatchUpdate (None if none). `pop_removed()` hands out the
    lowest free row: a request added in the same step takes it (and it is no longer "removed")."""

    def __init__(self) -> None:
        self._removed: list[int] = []
        self.added: list[AddedRequest] = []
        self.moved: list[MovedRequest] = []
        self._sorted = False

    @property
    def removed(self) -> list[int]:
        """Removed indices, highest first (so pop() yields the lowest)."""
        if not self._sorted:
            self._removed.sort(reverse=True)
            self._sorted = True
        return self._removed

    def removed_append(self, index: int) -> None:
        if self._sorted:
            raise RuntimeError("cannot register a removal after the removed indices have been read")
        self._removed.append(index)

    def peek_removed(self) -> int | None:
        return self.removed[-1] if self._removed else None

    def pop_removed(self) -> int | None:
        return self.removed.pop() if self._removed else None

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        self._sorted = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(batch_size, self._removed, self.added, self.moved)
        self._removed, self.added, self.moved = [], [], []
        return update


def process_dict_updates(
        req_entries: dict[int, T], batch_update: BatchUpdate | None,
        new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None]) -> bool:
    """Keep a sparse {row index: state} dict in step with the batch (vLLM's helper for processors
    that apply to few requests). `new_state(params, prompt_ids, output_ids)` is a row's state, or
    None where the processor does not apply. Returns whether anything changed."""
    if not batch_update:
        return False
    changed = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        elif req_entries.pop(index, None) is not None:  # took the row of one that had state
            changed = True
    if not req_entries:
        return changed
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        entry_a, entry_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if entry_a is not None:
            req_entries[b] = entry_a
            changed = True
        if direction is MoveDirectionality.SWAP and entry_b is not None:
            req_entries[a] = entry_b
            changed = True
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """Wraps a request-level processor so the batch-level engine can run it: subclasses implement
    `is_argmax_invariant` and `new_req_logits_processor(params)` (None: not for this request). One
    that overrides __init__ must call super().__init__(vllm_config, device, is_pin_memory)."""

    def __init__(self, vllm_config: EngineConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        # row -> the request's function with its token lists bound (references: they stay current)
        self.req_info: dict[int, partial] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's function, or None where this processor does not apply to it."""

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]):
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        wants_prompt = len(inspect.signature(fn).parameters) == 3
        return partial(fn, prompt_ids, output_ids) if wants_prompt else partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self.req_info.items():
            row_logits = logits[row]
            new = fn(row_logits)
            if new is not row_logits:  # a new tensor rather than the row changed in place
                logits[row] = new
        return logits


def load_logits_processor_classes(processors: Sequence[Any] | None) -> list[type[LogitsProcessor]]:
    """`LLM(logits_processors=[...])` entries as classes: a LogitsProcessor subclass, or vLLM's
    "module.path:ClassName" string. Anything else is a ValueError naming it."""
    classes = []
    for entry in processors or []:
        cls = entry
        if isinstance(entry, str):
            module, _, qualname = entry.partition(":")
            if not module or not qualname:
                raise ValueError(f"logits_processors: {entry!r} is not 'module.path:ClassName'")
            try:
                cls = importlib.import_module(module)
                for attr in qualname.split("."):
                    cls = getattr(cls, attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"logits_processors: cannot load {entry!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {entry!r} is not a subclass of LogitsProcessor "
                             f"(vLLM v1's batch-level interface; wrap a per-request function in "
                             f"AdapterLogitsProcessor)")
        classes.append(cls)
    return classes
