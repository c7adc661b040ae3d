"""Watching a Triton kernel work: one launch run by Triton's interpreter on CPU tensors, with a log
of what each program instance loads and of the float maxima it computes.

Why it exists: a compiled kernel cannot be watched from Python. Triton's interpreter, though,
executes the kernel's Python body with numpy, one program instance at a time, through a single
builder object that knows which instance is running (`grid_idx`). Wrapping two of the builder's
methods for the length of one launch shows the kernel's own reads (which block-table entries, which
cache rows) and its running maximum as it produced them, so chapter 08's figure and exercise never
recompute what the kernel did.

The interpreter is chosen as kernels are defined (TRITON_INTERPRET=1 before triton is imported).
In a process that compiled them for a GPU, an interpreted copy of one kernel is not enough (its
helpers, `tl.cdiv` among them, stay compiled and refuse to run outside a kernel), so there the
launch runs in a child Python that imports the kernels interpreted; arguments and log travel
through a temporary file, and the child's own error message is raised here if it fails.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minivllm import envs

Program = tuple[int, int, int]  # the kernel's program ids (tl.program_id(0), (1), (2))


@dataclass(frozen=True)
class Load:
    """One masked load of one program instance: the element offsets of its pointers into the
    launch argument `tensor` (its name in the launcher's signature; "" when none holds them), which
    lanes the mask kept, and, for integer tensors (block tables, lengths), the values read."""

    program: Program
    tensor: str
    offsets: np.ndarray
    mask: np.ndarray
    values: np.ndarray | None


@dataclass(frozen=True)
class Maximum:
    """One float elementwise maximum (`tl.maximum`) of one program instance, its result: in the
    attention kernels, the online softmax's new running max m_i after a tile."""

    program: Program
    values: np.ndarray


@dataclass(frozen=True)
class ProgramLog:
    """What `run_logged` returns: the launcher's own result and the events, in the order the
    interpreter executed them (program instance after program instance)."""

    result: Any
    events: list[Load | Maximum]

    def loads(self, tensor: str) -> list[Load]:
        return [e for e in self.events if isinstance(e, Load) and e.tensor == tensor]


def run_logged(launcher: Callable, *args: Any, **kwargs: Any) -> ProgramLog:
    """Call `launcher` (a kernel launcher such as `paged_decode_attention`) on CPU tensors with
    Triton's interpreter, logging every program instance's loads and float maxima."""
    from minivllm.kernels import interpreted

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(f"run_logged runs on CPU tensors (the interpreter's); got one on "
                             f"{value.device}: pass .cpu() copies")
    if interpreted():
        return _run_here(launcher, args, kwargs)
    return _run_in_child(launcher, args, kwargs)


def _run_here(launcher: Callable, args: tuple, kwargs: dict) -> ProgramLog:
    bound = inspect.signature(launcher).bind(*args, **kwargs)
    tensors = {name: t for name, t in bound.arguments.items() if isinstance(t, torch.Tensor)}
    events: list[Load | Maximum] = []
    with _logging_builder(tensors, events):
        result = launcher(*args, **kwargs)
    return ProgramLog(result, events)


@contextlib.contextmanager
def _logging_builder(tensors: dict[str, torch.Tensor], events: list) -> Iterator[None]:
    """The interpreter's builder, its masked load and float max wrapped to log, then restored."""
    from triton.runtime.interpreter import interpreter_builder as builder

    ranges = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
              for name, t in tensors.items()]
    load, maxnum = builder.create_masked_load, builder.create_maxnumf

    def logged_load(ptrs, mask, other, *rest):
        out = load(ptrs, mask, other, *rest)
        addr = ptrs.data.astype(np.int64)
        keep = np.broadcast_to(mask.data, addr.shape)
        inside = addr[keep] if keep.any() else addr.ravel()[:1]
        name, base, item = next(((n, lo, size) for n, lo, hi, size in ranges
                                 if inside.size and lo <= inside.min() and inside.max() < hi),
                                ("", 0, 1))
        values = out.data.copy() if np.issubdtype(out.data.dtype, np.integer) else None
        events.append(Load(builder.grid_idx, name, (addr - base) // item, keep.copy(), values))
        return out

    def logged_max(lhs, rhs):
        out = maxnum(lhs, rhs)
        if np.issubdtype(out.data.dtype, np.floating):
            events.append(Maximum(builder.grid_idx, np.array(out.data, copy=True)))
        return out

    builder.create_masked_load, builder.create_maxnumf = logged_load, logged_max
    try:
        yield
    finally:  # back to the class's own methods
        del builder.create_masked_load, builder.create_maxnumf


def _run_in_child(launcher: Callable, args: tuple, kwargs: dict) -> ProgramLog:
    with tempfile.TemporaryDirectory(prefix="minivllm-program-log-") as folder:
        request, answer = os.path.join(folder, "request.pkl"), os.path.join(folder, "answer.pkl")
        with open(request, "wb") as f:
            pickle.dump((launcher.__module__, launcher.__qualname__, args, kwargs), f)
        done = subprocess.run([sys.executable, "-m", __name__, request, answer],
                              env=envs.child_environment(TRITON_INTERPRET="1"),
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the interpreted launch failed in its child process:\n"
                               f"{done.stderr[-4000:]}")
        with open(answer, "rb") as f:
            return pickle.load(f)


def _child(request: str, answer: str) -> None:
    """The child's side: import the launcher with the kernels interpreted, run it logged, answer."""
    from minivllm.kernels import interpreted

    if not interpreted():
        raise RuntimeError("the kernels were compiled, not interpreted: TRITON_INTERPRET=1 must "
                           "be set before triton is imported")
    with open(request, "rb") as f:
        module, name, args, kwargs = pickle.load(f)
    log = _run_here(getattr(importlib.import_module(module), name), args, kwargs)
    with open(answer, "wb") as f:
        pickle.dump(log, f)


if __name__ == "__main__":  # by its package name, so that what it pickles names that module
    importlib.import_module("minivllm.kernels.program_log")._child(*sys.argv[1:3])
