"""The chapters run beside a competing CPU job (issue 36): a learner's laptop or a shared Colab machine is
rarely idle, and every sentence a chapter derives from a measurement must stay true when a core is busy.

From the first chapter cell pytest runs until the session ends, one process spins on the machine's last
core (pinned there), so every chapter in `make test` is checked under that load; the learner's second pass
(`make chapters-learner`, on a CPU with native bf16) runs the same way.
"""

import os
import subprocess
import sys

import pytest

COMPETITOR = pytest.StashKey[subprocess.Popen]()
SPIN = "import os; os.sched_setaffinity(0, {%d})\nwhile True:\n    pass"


def pytest_runtest_setup(item):
    if COMPETITOR not in item.config.stash:
        core = max(os.sched_getaffinity(0))
        item.config.stash[COMPETITOR] = subprocess.Popen([sys.executable, "-c", SPIN % core])


def pytest_unconfigure(config):
    competitor = config.stash.get(COMPETITOR, None)
    if competitor is not None:
        competitor.kill()
        competitor.wait()
