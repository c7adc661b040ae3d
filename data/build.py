"""Rebuild data/ from scratch: corpus -> tokenizer -> target -> draft -> evaluation.

Usage: ``python data/build.py`` (about 40 minutes on a 2-core CPU; progress is
written to data/build.log, so ``nohup python data/build.py &`` and
``tail -f data/build.log`` work well). Each stage runs in its own process so it
can also be rerun alone, e.g. ``python data/train.py draft`` then
``python data/evaluate.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent
STAGES = [["train.py", "tokenizer"], ["train.py", "target"], ["train.py", "draft"], ["evaluate.py"]]


def main() -> None:
    # Only the git-ignored staging area is wiped: each stage replaces its model folder when done,
    # so the previous models stay usable during the ~40 minute rebuild. Nothing reads old weights.
    shutil.rmtree(DATA / "corpus", ignore_errors=True)
    start = time.time()
    with open(DATA / "build.log", "w") as log:
        for script, *args in STAGES:
            cmd = [sys.executable, str(DATA / script), *args]
            log.write(f"$ {' '.join(cmd[1:])}\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:  # tee: terminal and log
                sys.stdout.write(line)
                log.write(line)
                log.flush()
            if proc.wait() != 0:
                sys.exit(f"stage {script} {args} failed with exit code {proc.returncode}")
        log.write(f"build finished in {(time.time() - start) / 60:.1f} min\n")


if __name__ == "__main__":
    main()
