"""Serving load test: N concurrent streaming clients against `minivllm serve` on loopback.

Each client sends a completion request (random token-id prompt, ignore_eos, a fixed number of output tokens),
streams it to the end, then sends the next, until --requests have been sent or --duration seconds have passed;
whatever is still in flight then is cancelled, so the run always ends by itself. The server runs in its own
process (started here unless --url is given), so clients and engine do not share a GIL.

Reports requests/s, output tokens/s, time to first token p50/p99 and time per output token p50/p99
(per request: time from first to last chunk over output tokens after the first).

    python bench/serve_load.py [--model PATH | --random-model | --url http://127.0.0.1:8000] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import start_server, stop_server  # noqa: E402


@dataclass
class Result:
    ttft: float  # seconds from sending to the first chunk
    tpot: float | None  # seconds per output token after the first
    tokens: int
    total: float


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 64 samples is the largest)."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict, leave_after: int = 0) -> Result | None:
    """One streamed request to its end; or, with `leave_after`, hang up after that many chunks (returns None).
    With continuous_usage_stats asked for, every chunk that carries text must carry usage too."""
    continuous = body["stream_options"].get("continuous_usage_stats", False)
    start = time.perf_counter()
    chunks = 0
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            if leave_after and chunks >= leave_after:
                return None  # leaving the `async with` closes the connection: the server must abort the request
            if continuous and chunk["choices"] and not chunk.get("usage"):
                raise RuntimeError("continuous_usage_stats was asked for, but a chunk came without usage")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Result(first - start, tpot, tokens, last - start)


async def run_load(url: str, clients: int, requests: int, duration: float, prompt_tokens: int, max_tokens: int,
                   vocab: int, seed: int, disconnect_every: int = 0,
                   continuous_usage: bool = False) -> tuple[list[Result], int, float, int]:
    """Returns (finished results, errors, wall seconds, requests the client hung up on)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    todo = iter(range(requests))
    results: list[Result] = []
    errors = left = 0
    stop_at = time.perf_counter() + duration

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors, left
        for i in todo:
            if time.perf_counter() >= stop_at:
                return
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": continuous_usage}}
            leave = 3 if disconnect_every and i % disconnect_every == disconnect_every - 1 else 0
            try:
                result = await one_request(client, url, body, leave)
                if result is None:
                    left += 1
                else:
                    results.append(result)
            except (httpx.HTTPError, RuntimeError) as e:
                errors += 1
                print(f"request {i} failed: {e}", file=sys.stderr)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration + 30), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(worker(client)) for _ in range(clients)]
        _, late = await asyncio.wait(tasks, timeout=duration + 5)
        for t in late:  # past the deadline: cancel what is in flight (the server aborts those requests)
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        wall = time.perf_counter() - start
    return results, errors, wall, left


def server_blocks(url: str, wait: float = 10.0) -> dict[str, float]:
    """Once the server is idle (or after `wait` s): running, waiting, and KV blocks held, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait
    while True:
        m = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
             for s in f.samples}
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return {"running": m["vllm:num_requests_running"], "waiting": m["vllm:num_requests_waiting"],
                    "blocks_held": m["minivllm:kv_blocks_total"] - m["minivllm:kv_blocks_free"]}
        time.sleep(0.1)


def random_model(path: Path) -> Path:
    """A small random Llama (no tokenizer: the bench sends token ids), for when no trained model is at hand."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--url", help="an already running server (default: start one here)")
    where.add_argument("--model", default=None, help="checkpoint for the server started here (default: embedded)")
    where.add_argument("--random-model", action="store_true", help="serve a small random Llama instead")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120.0, help="stop sending after this many seconds")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-token-id", type=int, default=256, help="prompts use token ids below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disconnect-every", type=int, default=0,
                    help="every K-th request hangs up after 3 chunks (0: none); the server must abort it")
    ap.add_argument("--continuous-usage", action="store_true",
                    help="ask for usage in every chunk (vLLM's stream_options.continuous_usage_stats), as "
                         "OpenAI-API benchmark tools do, and check that every chunk carries it")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to `minivllm serve` (repeatable)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = ap.parse_args()

    proc, tmp = None, None
    url = args.url
    if url is None:
        model = args.model
        if args.random_model:
            tmp = tempfile.TemporaryDirectory()
            model = str(random_model(Path(tmp.name) / "random-llama"))
        if model is None:
            from minivllm.config import DEFAULT_MODEL

            model = str(DEFAULT_MODEL)
        proc, url = start_server(["--model", model, "--log-level", "warning", *args.server_arg])
    try:
        info = httpx.get(url + "/v1/models").json()["data"][0]
        asyncio.run(run_load(url, 1, 1, 60, args.prompt_tokens, 4, args.max_token_id, args.seed + 1))  # warm-up
        results, errors, wall, left = asyncio.run(run_load(url, args.clients, args.requests, args.duration,
                                                           args.prompt_tokens, args.max_tokens, args.max_token_id,
                                                           args.seed, args.disconnect_every, args.continuous_usage))
        after = server_blocks(url)
    finally:
        stop_server(proc)
        if tmp is not None:
            tmp.cleanup()

    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    tokens = sum(r.tokens for r in results)
    figures = {
        "model": info["id"], "clients": args.clients, "requests_done": len(results), "errors": errors,
        "continuous_usage": args.continuous_usage,
        "hung_up": left, "blocks_held_after": after["blocks_held"],
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 99), 4) if ttft else None,
        "tpot_p50_s": round(statistics.median(tpot), 4) if tpot else None,
        "tpot_p99_s": round(percentile(tpot, 99), 4) if tpot else None,
    }
    print(f"machine: {os.cpu_count()} cores; server {url} serving {info['id']}")
    print(f"{args.clients} clients, {len(results)}/{args.requests} requests done ({errors} errors) in {wall:.1f} s; "
          f"prompt {args.prompt_tokens} tokens, output {args.max_tokens} tokens (ignore_eos, greedy)")
    print(f"throughput: {figures['requests_per_s']} requests/s, {figures['output_tokens_per_s']} output tokens/s")
    print(f"time to first token: p50 {figures['ttft_p50_s']} s, p99 {figures['ttft_p99_s']} s")
    print(f"time per output token: p50 {figures['tpot_p50_s']} s, p99 {figures['tpot_p99_s']} s")
    print(f"clients that hung up: {left}; afterwards {after['running']:.0f} running, {after['waiting']:.0f} waiting, "
          f"{after['blocks_held']:.0f} KV blocks held (cached blocks count as free: 0 means none leaked)")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
