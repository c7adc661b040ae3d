"""The short version of bench/soak.py: the server under mixed clients (streams hung up, n=2 with logprobs,
structured answers, shared prefixes, prompts filling most of a small KV pool), then idle with every block
free and memory, descriptors and threads back near their warm values, then SIGTERM with requests in flight:
each ends and the server exits. The long run (20 minutes, a killed tensor-parallel worker) is in bench/."""

import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_short_soak_loses_and_leaks_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(SOAK), "--minutes", "0.25", "--clients", "6", "--tp", "1",
                          "--warmup", "8", "--out", str(tmp_path / "soak")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("PASS"), run.stdout[-3000:] + run.stderr[-3000:]
    assert "| stream | ok |" in run.stdout and "| free blocks | | 64 of 64 |" in run.stdout
    assert (tmp_path / "soak.png").stat().st_size > 0
