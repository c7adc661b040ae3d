"""A checker's verdict, and the runner that turns a list of checks into one.

A check is a plain function that raises ExerciseFailure with a sentence a learner can act on. The
runner stops at the first failure: later checks usually fail for the same reason and would only add
noise.
"""

from __future__ import annotations

import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class ExerciseFailure(AssertionError):
    """A check found the learner's code wrong; the message says how, in plain words."""


@dataclass
class Report:
    exercise: str
    status: str  # "passed", "failed" or "not attempted"
    message: str = ""
    passed_checks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        lines = [f"{self.exercise}: {self.status.upper()} ({self.seconds:.1f} s)"]
        lines += [f"  ok  {name}" for name in self.passed_checks]
        # wrapped to 100 columns, the width a notebook output shows without a scroll bar
        lines += [textwrap.fill(part, 100, initial_indent="  ", subsequent_indent="  ",
                                break_long_words=False, break_on_hyphens=False)
                  for part in self.message.split("\n") if self.message]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the verdict, not the dataclass
        p.text(str(self))


def run_checks(exercise: str, checks: Sequence[tuple[str, Callable[[], None]]]) -> Report:
    """Run the checks in order; the first that fails (or raises) decides the verdict."""
    start, passed = time.perf_counter(), []

    def report(status: str, message: str = "") -> Report:
        return Report(exercise, status, message, passed, time.perf_counter() - start)

    for name, check in checks:
        try:
            check()
        except NotImplementedError as stub:
            where = traceback.extract_tb(stub.__traceback__)[-1]
            return report("not attempted", f"`{where.name}` still raises NotImplementedError: "
                          "write it in the exercise cell, run that cell, then run the checker "
                          "again.")
        except ExerciseFailure as failure:
            return report("failed", f"while checking that {name}:\n{failure}")
        except Exception as error:  # the learner's code crashed: say where, briefly
            frame = traceback.extract_tb(error.__traceback__)[-1]
            return report("failed", f"while checking that {name}, your code raised "
                          f"{type(error).__name__}: {error} (at {frame.name}, line {frame.lineno})")
        passed.append(name)
    return report("passed")
