"""The GPU benchmark scripts run end to end on CPU (--cpu-check), so they cannot rot between GPU sessions. Each is a
subprocess whose output the tests read; they start beside the rest of the suite (tests/head_start.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from head_start import head_start_result

BENCH = Path(__file__).resolve().parent.parent / "bench"
CPU_CHECKS = {"gpu_kernels.py": "all checks passed", "gpu_throughput.py": "ratio minivllm / transformers"}
MOE_SMOKE = [sys.executable, str(BENCH / "moe_decode.py"), "--smoke", "--batches", "1", "4"]


def head_start(folder: Path) -> dict[str, subprocess.CompletedProcess]:
    """Each script's run, by name."""
    runs = {script: subprocess.run([sys.executable, str(BENCH / script), "--cpu-check"], capture_output=True,
                                   text=True, timeout=600) for script in CPU_CHECKS}
    runs["moe_decode.py"] = subprocess.run(MOE_SMOKE, capture_output=True, text=True, timeout=600, cwd=BENCH.parent,
                                           env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    return runs


@pytest.fixture(scope="module")
def runs(request) -> dict[str, subprocess.CompletedProcess]:
    return head_start_result(request)


@pytest.mark.parametrize("script", CPU_CHECKS)
def test_cpu_check(runs, script):
    run = runs[script]
    assert run.returncode == 0, run.stdout + run.stderr
    assert CPU_CHECKS[script] in run.stdout


def test_gpu_check_parses_and_says_when_there_is_no_gpu(tmp_path):
    """`make gpu-check` cannot run here; its script must at least parse, and off a GPU stop at once, saying why
    (exit 2), before it installs anything or writes a results file."""
    script = BENCH / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `make gpu-check` itself")
    results = tmp_path / "results.md"
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "GPU_CHECK_RESULTS": str(results)})
    assert run.returncode == 2 and "no CUDA GPU" in run.stderr and not results.exists()


def test_moe_decode_smoke_run(runs):
    """bench/moe_decode.py with --smoke (8 tokens, no figures kept): both engines decode the embedded MoE, and the
    bytes column comes from the trace: batch 1 reads exactly k of E experts per layer."""
    run = runs["moe_decode.py"]
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.split() and line.split()[0] in ("1", "4")]
    assert [r[0] for r in rows] == ["1", "4"], run.stdout
    assert rows[0][4:6] == ["2.00", "2.00"] and rows[0][-1] == "25.0%", run.stdout  # 2 of 8 experts per layer
