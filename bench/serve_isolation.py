"""Isolation: while one hostile request (inside every limit) runs, how long do other clients wait?

For each row of issue 28's table, the hostile request(s) run in their own threads while two other clients probe
the server: one GETs /health every --every seconds, the other sends a 1-token completion every --every seconds
(each waits for its answer first). Reported per row: the hostile request's status and time, and the worst
/health and worst completion latency seen while it ran (with the probe counts). The server runs in its own
process (started here unless --url is given), so the probes do not share its GIL.

    python bench/serve_isolation.py [--model PATH | --url URL] [--scale 1.0] [--rows prompt_lists,...] [--json]

--scale shrinks the sizes (the tests run every row at a small scale against a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import start_server, stop_server  # noqa: E402


@dataclass
class Hostile:
    """What the hostile side saw: one entry per request it sent."""

    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    notes: dict = field(default_factory=dict)


def post(url: str, body: dict | bytes, out: Hostile, headers: dict | None = None, timeout: float = 600) -> dict | None:
    t0 = time.perf_counter()
    kw = {"content": body, "headers": {"content-type": "application/json", **(headers or {})}} \
        if isinstance(body, bytes) else {"json": body, "headers": headers}
    r = httpx.post(url + "/v1/completions", timeout=timeout, **kw)
    out.seconds.append(round(time.perf_counter() - t0, 3))
    out.statuses.append(r.status_code)
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else None


def prompt_lists(url: str, scale: float, out: Hostile) -> None:
    """100,000 one-token prompts, max_tokens=1: 100,000 choices to admit, run and answer."""
    n = max(1, int(100_000 * scale))
    body = post(url, {"prompt": [[5]] * n, "max_tokens": 1}, out)
    out.notes["choices"] = len(body["choices"]) if body and "choices" in body else None


def prompt_logprobs_all(url: str, scale: float, out: Hostile) -> None:
    """prompt_logprobs=-1 (the whole vocabulary per prompt position): refused unless --max-logprobs -1."""
    body = post(url, {"prompt": [5] * max(2, int(1000 * scale)), "max_tokens": 1, "prompt_logprobs": -1}, out)
    out.notes["error"] = (body or {}).get("error", {}).get("message", "")[:100] or None


def prompt_logprobs_max(url: str, scale: float, out: Hostile) -> None:
    """The most max_logprobs allows (20) for every position of a long prompt, echoed back."""
    body = post(url, {"prompt": [5] * max(2, int(1000 * scale)), "max_tokens": 1, "prompt_logprobs": 20,
                      "logprobs": 20, "echo": True}, out)
    if body and "choices" in body:
        out.notes["logprob_positions"] = len(body["choices"][0]["logprobs"]["tokens"])


def huge_texts(url: str, scale: float, out: Hostile) -> None:
    """Two 3.9 MB text prompts at once: two long tokenizations (each then refused: longer than the context)."""
    text = ("The quick brown fox jumps over the lazy dog. " * (int(3.9e6 * scale) // 45 + 1))[: int(3.9e6 * scale)]
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    both = [threading.Thread(target=post, args=(url, body, out)) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join()


def many_prompts_stream(url: str, scale: float, out: Hostile) -> None:
    """20,000 prompts x max_tokens=1, streamed: the longest gap between two chunks is the stall."""
    n = max(1, int(20_000 * scale))
    t0 = time.perf_counter()
    last, gap, chunks = None, 0.0, 0
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [[5]] * n, "max_tokens": 1, "stream": True},
                      timeout=600) as r:
        out.statuses.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                gap = max(gap, now - last) if last is not None else gap
                last, chunks = now, chunks + 1
    out.seconds.append(round(time.perf_counter() - t0, 3))
    out.notes.update(chunks=chunks, max_chunk_gap_s=round(gap, 3))


def same_request_id(url: str, scale: float, out: Hostile) -> None:
    """Two requests with one X-Request-Id at once: both must be served."""
    body = {"prompt": [5, 6, 7], "max_tokens": max(2, int(64 * scale)), "ignore_eos": True}
    ids: list[str] = []

    def one() -> None:
        got = post(url, body, out, headers={"X-Request-Id": "same-id"})
        ids.append((got or {}).get("id"))

    both = [threading.Thread(target=one) for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    out.notes["response_ids"] = ids


def slow_clients(url: str, scale: float, out: Hostile) -> None:
    """30 connections that send half their headers and then nothing: how long until the server closes them."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(max(1, int(30 * scale))):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
        socks.append(s)
    t0 = time.perf_counter()
    held = []
    for s in socks:
        s.settimeout(max(1.0, 120 - (time.perf_counter() - t0)))
        try:
            answer = s.recv(4096)
            while s.recv(4096):
                pass
        except OSError:
            answer = b""
        held.append(time.perf_counter() - t0)
        out.statuses.append(int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else 0)
        s.close()
    out.seconds.append(round(max(held), 3))
    out.notes["held_max_s"] = round(max(held), 3)


ROWS: dict[str, Callable[[str, float, Hostile], None]] = {
    "prompt_lists": prompt_lists, "prompt_logprobs_all": prompt_logprobs_all,
    "prompt_logprobs_max": prompt_logprobs_max, "huge_texts": huge_texts,
    "many_prompts_stream": many_prompts_stream, "same_request_id": same_request_id, "slow_clients": slow_clients,
}


def measure(url: str, row: str, scale: float = 1.0, every: float = 0.5, probe_timeout: float = 60.0) -> dict:
    """Run one row while probing /health and a 1-token completion; the worst latencies seen meanwhile."""
    hostile, done = Hostile(), threading.Event()
    health: list[float] = []
    completion: list[float] = []
    failures: list[str] = []

    def run_row() -> None:
        try:
            ROWS[row](url, scale, hostile)
        except Exception as e:  # reported, not raised: the probes' figures still count
            failures.append(f"hostile: {e!r}")
        finally:
            done.set()

    def probe(record: list[float], call: Callable[[httpx.Client], httpx.Response]) -> None:
        with httpx.Client(base_url=url, timeout=probe_timeout) as c:
            while True:  # at least one probe, however quickly the hostile request ends
                t0 = time.perf_counter()
                try:
                    r = call(c)
                    if r.status_code != 200:
                        failures.append(f"probe HTTP {r.status_code}: {r.text[:100]}")
                except httpx.HTTPError as e:
                    failures.append(f"probe: {e!r}")
                record.append(time.perf_counter() - t0)
                if done.wait(every):
                    return

    probes = [threading.Thread(target=probe, args=(health, lambda c: c.get("/health"))),
              threading.Thread(target=probe, args=(completion, lambda c: c.post(
                  "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})))]
    t0 = time.perf_counter()
    worker = threading.Thread(target=run_row)
    worker.start()
    time.sleep(0.05)  # the hostile request is on its way before the first probes
    for t in probes:
        t.start()
    worker.join()
    wall = time.perf_counter() - t0
    for t in probes:
        t.join()
    return {"row": row, "scale": scale, "hostile_status": hostile.statuses, "hostile_s": hostile.seconds,
            "wall_s": round(wall, 3), **hostile.notes,
            "health_worst_s": round(max(health), 3) if health else None, "health_probes": len(health),
            "completion_worst_s": round(max(completion), 3) if completion else None,
            "completion_probes": len(completion), "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", help="an already running server (default: start one here)")
    where.add_argument("--model", default=None, help="checkpoint for the server started here (default: embedded)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="size factor for every row (1: the issue's sizes)")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between probes")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to `minivllm serve` (repeatable)")
    ap.add_argument("--json", action="store_true", help="also print each row as one JSON line")
    args = ap.parse_args()
    proc, url = None, args.url
    if url is None:
        from minivllm.config import DEFAULT_MODEL

        proc, url = start_server(["--model", args.model or str(DEFAULT_MODEL), "--log-level", "warning",
                                  *args.server_arg])
    try:
        info = httpx.get(url + "/v1/models").json()["data"][0]
        print(f"machine: {os.cpu_count()} cores; server {url} serving {info['id']} (max_model_len "
              f"{info['max_model_len']}); probes every {args.every} s")
        for row in args.rows.split(","):
            res = measure(url, row, args.scale, args.every)
            print(f"{row:>20}: hostile {res['hostile_status']} in {res['hostile_s']} s; others waited up to "
                  f"{res['health_worst_s']} s for /health ({res['health_probes']} probes), "
                  f"{res['completion_worst_s']} s for a 1-token completion ({res['completion_probes']}); "
                  + ", ".join(f"{k}={v}" for k, v in res.items() if k not in (
                      "row", "scale", "hostile_status", "hostile_s", "health_worst_s", "health_probes",
                      "completion_worst_s", "completion_probes")))
            if args.json:
                print(json.dumps(res))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
