"""The GPU benchmark scripts run end to end on CPU (--cpu-check), so they cannot rot between GPU sessions."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script,expect", [("gpu_kernels.py", "all checks passed"),
                                           ("gpu_throughput.py", "ratio minivllm / transformers")])
def test_cpu_check(script, expect):
    run = subprocess.run([sys.executable, str(BENCH / script), "--cpu-check"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert expect in run.stdout
