"""`minivllm serve` started for a benchmark, as an operator would: one helper for the benches that drive a real
server (serve_load.py, serve_isolation.py, soak.py), whatever flags, environment and start-up deadline they need."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    """A port the OS has just given out (a benchmark's server may keep it across restarts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: Sequence[str], *, port: int | None = None, env: Mapping[str, str] | None = None,
                 deadline_s: float = 180.0, log: Path | None = None,
                 program: Sequence[str] = (sys.executable, "-m", "minivllm")) -> tuple[subprocess.Popen, str]:
    """Start `PROGRAM serve --port PORT FLAGS` (`minivllm` unless given, e.g. a venv's `vllm`; a free port unless
    given) with `env` added to this process's environment, and return (process, base URL) once /health answers
    200. Its output goes to `log` (a file, so that a chatty server never blocks on a full pipe) or to this
    terminal. A server that exits, or is not up within `deadline_s`, ends the benchmark with the reason (and the
    log's tail)."""
    port = port or free_port()
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - the server writes it until it exits
    proc = subprocess.Popen([*program, "serve", "--port", str(port), *flags],
                            stdout=out, stderr=subprocess.STDOUT if out else None, env={**os.environ, **(env or {})})
    if out is not None:
        out.close()  # the server has its own copy
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = f": {log.read_text()[-2000:]}" if log is not None else ""
            raise SystemExit(f"the server exited with {proc.returncode}{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"the server did not come up within {deadline_s:.0f} s")


def stop_server(proc: subprocess.Popen | None, sig: int = signal.SIGINT,
                timeout_s: float = 30.0) -> tuple[float, int | None]:
    """Send `sig` (SIGINT: Ctrl-C, as an operator would; SIGTERM: an orchestrator's stop) and wait; killed after
    `timeout_s`. Returns (seconds until it exited, its exit code, None when it had to be killed)."""
    if proc is None:
        return 0.0, None
    start = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return time.monotonic() - start, code
