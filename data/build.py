"""Rebuild data/ from scratch: corpus -> tokenizer -> target -> draft -> moe -> evaluation.

Usage: ``python data/build.py`` (20-40 minutes on a 2-core CPU; progress is
written to data/build.log, so ``nohup python data/build.py &`` and
``tail -f data/build.log`` work well). ``python data/build.py --resume`` continues
an interrupted build: finished stages are skipped and training resumes from its
last checkpoint. Each stage runs in its own process so it can also be rerun alone,
e.g. ``python data/train.py draft`` then ``python data/evaluate.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent
STAGES = [["train.py", "tokenizer"], ["train.py", "target"], ["train.py", "draft"], ["train.py", "moe"],
          ["evaluate.py"]]


def main(resume: bool) -> None:
    # Only the git-ignored staging area (tokenizer, checkpoints, stage markers) is wiped: each stage
    # replaces its model folder when done, so the previous models stay usable during the rebuild.
    staging = DATA / "corpus"
    if not resume:
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(exist_ok=True)
    start = time.time()
    with open(DATA / "build.log", "a" if resume else "w") as log:
        for script, *args in STAGES:
            done = staging / f"done-{'-'.join([script.removesuffix('.py'), *args])}"
            if done.exists():
                log.write(f"skipping finished stage {script} {' '.join(args)}\n")
                continue
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
            done.touch()
        log.write(f"build finished in {(time.time() - start) / 60:.1f} min\n")


if __name__ == "__main__":
    main(resume="--resume" in sys.argv[1:])
