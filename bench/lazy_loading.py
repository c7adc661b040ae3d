"""Lazy vs eager loading: cold start to the first token, and memory before and after it.

Each run is a fresh process (`python -c`, the way a learner's script starts) that imports minivllm,
builds `LLM(checkpoint, lazy_loading=...)` and generates one 16-token prompt's first token. Times
are from the process's own start (its /proc start time) to: `LLM(...)` returned, and the first
token came back. RSS is read after `LLM(...)` and after the first request. The checkpoints are
bench/cpu_peer.py's random 135M- and 360M-shaped Llama models (saved in float32, loaded in the
engine's default dtype). Modes alternate within each round; the table gives each figure's median.

    PYTHONPATH=. python bench/lazy_loading.py [--shapes 135m,360m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import build_checkpoint  # noqa: E402

CHILD = """
import json, os, sys, time
def since_start():
    ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    boot = time.time() - float(open("/proc/uptime").read().split()[0])
    return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))
def rss_mib():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], lazy_loading=sys.argv[2] == "lazy", num_kv_blocks=64)
ready, rss_ready = since_start(), rss_mib()
llm.generate([list(range(5, 21))], SamplingParams(max_tokens=1), use_tqdm=False)
print(json.dumps({"ready_s": ready, "first_token_s": since_start(), "rss_ready_mib": rss_ready,
                  "rss_served_mib": rss_mib()}))
"""


def run(path: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True,
                         text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="135m,360m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            t0 = time.perf_counter()
            path = build_checkpoint(shape, Path(tmp))
            print(f"\n[{shape}] random checkpoint built in {time.perf_counter() - t0:.0f} s")
            results: dict[str, list[dict]] = {"eager": [], "lazy": []}
            for _ in range(args.rounds):
                for mode in ("eager", "lazy"):
                    results[mode].append(run(path, mode))
            print(f"{'mode':6s} {'LLM() ready s':>13s} {'first token s':>13s} "
                  f"{'RSS ready MiB':>13s} {'RSS served MiB':>14s}")
            for mode, rows in results.items():
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                print(f"{mode:6s} {med['ready_s']:13.2f} {med['first_token_s']:13.2f} "
                      f"{med['rss_ready_mib']:13.0f} {med['rss_served_mib']:14.0f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
