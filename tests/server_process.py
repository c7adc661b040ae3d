"""`python -m minivllm serve` as a test's subprocess, the way an operator starts it: one helper for the tests
that need the real process (its signals, its engine processes, its exit), whatever flags they pass."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx


def start_server(model: str | Path, *flags: str, env: Mapping[str, str] | None = None,
                 deadline_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start `minivllm serve --model MODEL FLAGS` on a free port with `env` added to this process's
    environment; return (process, base URL) once /health answers 200. Its output (stdout and stderr) is
    the process's `stdout` pipe; a server that exits or is not up within `deadline_s` fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--model", str(model), "--port", str(port),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stdout.read().decode()}")
        if time.monotonic() > deadline:
            stop_server(proc)
            raise AssertionError(f"the server did not come up within {deadline_s} s")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (the server's graceful stop) if it still runs; killed if it is not gone within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
