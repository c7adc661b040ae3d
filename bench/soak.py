"""The server under faults, for minutes (issue 41): mixed clients, a KV pool kept full, hang-ups, a killed
worker, SIGTERM with streams open. Nothing may be lost, leak or hang.

`minivllm serve` runs the embedded model in its own process with an API key, prefix caching, a KV pool of
`--kv-blocks` blocks (small on purpose: preemption runs all the time) and, with `--tp 2`, two tensor-parallel
ranks. `--clients` asyncio clients, each with the real `openai` client, send one request after another, drawn
at random: a streamed chat completion (a fifth of them hung up after a few chunks), completions with n=2 and
logprobs, a structured chat answer (a JSON schema, or a choice), a prompt sharing a long prefix with others,
and a prompt close to the context length.

Faults, on a schedule: at `--kill-at` of the run a process of the engine is SIGKILLed: with `--dp 2` a
data-parallel engine (a whole engine in its own process), else a tensor-parallel worker. The server's design
(minivllm/server/app.py, data_parallel.py): the engine is dead, every request then gets HTTP 503 naming the dead
process, `/health` says 503 with the cause, and the operator restarts it; here that is checked (the run fails
otherwise), then the server is stopped with SIGTERM and a new one started, and the load goes on. At the end
SIGTERM arrives with streams open: each must end (finished or an error), and the process must exit within 30 s.

Sampled every `--every` seconds: the server's resident memory (its process tree), open descriptors and
threads, running and waiting requests, free KV blocks, preemptions. After the load and before the final
SIGTERM the server must go idle with every block free, and memory, descriptors and threads must be back
within `--rss-bound` MiB / 16 / 4 of their values after warm-up (the first sample `--warmup` s after the
last start).

    python bench/soak.py [--minutes 20] [--clients 32] [--tp 2] [--dp 1] [--out bench/soak]

Prints the table (requests completed / failed by reason, faults, drift of each resource) and writes
`<out>.json` and `<out>.png` (resources over time, faults marked). Exits 1 if anything was lost or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import free_port, start_server, stop_server  # noqa: E402

KEY = "soak-key"
BLOCK_BYTES = 2 * 6 * 16 * 4 * 32 * 4  # K and V, 6 layers, 16 tokens, 4 KV heads of 32, fp32: the embedded model
PREFIX = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who " * 6


def tree(pid: int) -> list[int]:
    """pid and every process under it."""
    parent = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            parent[int(status.parent.name)] = int(fields["PPid"])
        except (OSError, KeyError, ValueError):
            continue
    ours, grown = {pid}, True
    while grown:
        more = ours | {p for p, pp in parent.items() if pp in ours}
        grown, ours = more != ours, more
    return sorted(ours)


def resources(pid: int) -> dict:
    """RSS (MiB, the whole tree), open descriptors and threads (the server process itself)."""
    rss = 0
    for p in tree(pid):
        try:
            rss += int(next(ln for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                            if ln.startswith("VmRSS")).split()[1])
        except (OSError, StopIteration):
            continue
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln for ln in status.splitlines() if ln.startswith("Threads")).split()[1])
    return dict(rss_mib=rss / 1024, fds=len(os.listdir(f"/proc/{pid}/fd")), threads=threads)


def metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return dict(running=m["vllm:num_requests_running"], waiting=m["vllm:num_requests_waiting"],
                blocks_free=m["minivllm:kv_blocks_free"], blocks_total=m["minivllm:kv_blocks_total"],
                preemptions=m.get("vllm:num_preemptions_total", m.get("vllm:num_preemptions", 0.0)))


class Server:
    """One `minivllm serve` process (bench/serve_process.py), on one port across restarts; output to a log."""

    def __init__(self, args) -> None:
        self.args, self.proc, self.port = args, None, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.gettempdir()) / f"minivllm-soak-{self.port}.log"

    def start(self) -> None:
        a = self.args
        self.proc, _ = start_server(
            ["--api-key", KEY, "--log-level", "warning", "--enable-prefix-caching", "--max-num-seqs", str(a.clients),
             "--kv-cache-memory-bytes", str(a.kv_blocks * BLOCK_BYTES // a.tp), "-tp", str(a.tp), "-dp", str(a.dp)],
            port=self.port, deadline_s=300, log=self.log)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[float, int | None]:
        """Send `sig`; (seconds until it exited, its exit code), killed (code None) after `timeout`."""
        return stop_server(self.proc, sig, timeout)


async def one_request(client, rng: random.Random, log: Counter) -> None:
    """One request of a random kind; its outcome counted by kind and result."""
    kind = rng.choice(["stream", "stream", "n2_logprobs", "structured", "prefix", "long"])
    try:
        if kind == "stream":
            stream = await client.chat.completions.create(
                model="minivllm-tiny", messages=[{"role": "user", "content": f"Tell story {rng.random()}"}],
                max_tokens=rng.randint(16, 96), stream=True)
            hang_up = rng.random() < 0.2
            chunks = 0
            async for _ in stream:
                chunks += 1
                if hang_up and chunks == 3:
                    await stream.close()
                    log[(kind, "hung up")] += 1
                    return
        elif kind == "n2_logprobs":
            out = await client.completions.create(model="minivllm-tiny", prompt=f"The sea {rng.random()}",
                                                  max_tokens=rng.randint(8, 48), n=2, logprobs=3)
            assert len(out.choices) == 2 and out.choices[0].logprobs is not None
        elif kind == "structured":
            if rng.random() < 0.5:
                out = await client.chat.completions.create(
                    model="minivllm-tiny", messages=[{"role": "user", "content": "Yes or no?"}], max_tokens=8,
                    extra_body={"guided_choice": ["yes", "no"]})
                assert out.choices[0].message.content in ("yes", "no")
            else:
                schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
                out = await client.chat.completions.create(
                    model="minivllm-tiny", messages=[{"role": "user", "content": "A number"}], max_tokens=24,
                    response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
                if out.choices[0].finish_reason == "stop":
                    json.loads(out.choices[0].message.content)
        elif kind == "prefix":
            await client.completions.create(model="minivllm-tiny", prompt=PREFIX + str(rng.random()),
                                            max_tokens=rng.randint(8, 64))
        else:  # close to the context length: 1024 tokens
            await client.completions.create(model="minivllm-tiny", prompt="word " * rng.randint(300, 420),
                                            max_tokens=128)  # 600-850 prompt tokens: most of the pool
        log[(kind, "ok")] += 1
    except Exception as e:  # noqa: BLE001 - every failure is counted with its reason
        status = getattr(e, "status_code", "")
        message = str(e).strip()
        message = re.sub(r"\d+", "N", message)[:100]  # "prompt has 1601 tokens": one row for all lengths
        log[(kind, f"{type(e).__name__} {status}: {message}" if message else "UNEXPLAINED")] += 1


async def clients(server: Server, n: int, until: float, log: Counter, seed: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < until:
            await one_request(client, rng, log)

    await asyncio.gather(*(loop(i) for i in range(n)))
    await client.close()


async def sampler(server: Server, samples: list, every: float, stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        try:
            row = dict(t=time.monotonic() - t0, **resources(server.proc.pid))
            row.update(await asyncio.to_thread(metrics, server.url))
            samples.append(row)
        except (OSError, httpx.HTTPError, KeyError, StopIteration):
            pass  # the server is restarting: no sample this time
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


def kill_engine_process(server: Server) -> tuple[int, str]:
    """SIGKILL the last process the server spawned: a data-parallel engine with `--dp` > 1 (each runs its own
    tensor-parallel ranks below it, if any), else a tensor-parallel worker. Returns (its pid, what it was)."""
    spawned = []
    for p in tree(server.proc.pid):
        try:
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes():  # not the resource tracker
                spawned.append(p)
        except OSError:
            continue
    dp = server.args.dp > 1
    victim = [p for p in spawned if Path(f"/proc/{p}/status").exists()
              and (not dp or f"PPid:\t{server.proc.pid}\n" in Path(f"/proc/{p}/status").read_text())][-1]
    os.kill(victim, signal.SIGKILL)
    return victim, "data-parallel engine" if dp else "tensor-parallel worker"


async def run(args) -> dict:
    server = Server(args)
    server.start()
    t0 = time.monotonic()
    end, kill_at = t0 + args.minutes * 60, t0 + args.minutes * 60 * args.kill_at
    samples, log, events = [], Counter(), []
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(server, samples, args.every, stop, t0))
    killed_ok = None
    if args.tp > 1 or args.dp > 1:  # an engine process dies under load; a restarted server takes the rest

        async def kill_later() -> None:
            await asyncio.sleep(kill_at - time.monotonic())
            pid, what = kill_engine_process(server)
            events.append((time.monotonic() - t0, f"{what} {pid} killed under load"))

        killer = asyncio.create_task(kill_later())
        await clients(server, args.clients, kill_at + 5, log, seed=1)  # in flight, and after: errors
        await killer
        health = httpx.get(server.url + "/health", timeout=10)
        probe = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "minivllm-tiny", "prompt": "hi", "max_tokens": 4}, timeout=30)
        events.append((time.monotonic() - t0, f"after the kill: /health {health.status_code}, "
                       f"a request {probe.status_code} {probe.text[:160]!r}"))
        # the design (minivllm/server/app.py, data_parallel.py): 503 with the cause, from then on
        cause = ("engine" if args.dp > 1 else "rank") + " "
        killed_ok = (health.status_code == probe.status_code == 503 and cause in probe.text
                     and cause in health.text and ("exited" in probe.text or "raised" in probe.text))
        secs, code = server.stop()
        events.append((time.monotonic() - t0, f"stopped (SIGTERM) in {secs:.1f} s, exit {code}"))
        server.start()
        events.append((time.monotonic() - t0, "restarted"))
    measured_from = time.monotonic() - t0 + args.warmup  # the server measured at the end, once warm
    await clients(server, args.clients, end, log, seed=2)
    idle = await asyncio.to_thread(wait_idle, server)
    events.append((time.monotonic() - t0, f"idle after the load: {idle}"))
    # SIGTERM with streams open: start streams, then stop the server under them
    open_log: Counter = Counter()
    streams = asyncio.create_task(clients(server, 8, time.monotonic() + 3, open_log, seed=3))
    await asyncio.sleep(3)  # no client starts a request after this: those in flight meet the SIGTERM
    secs, code = server.stop()
    events.append((time.monotonic() - t0, f"SIGTERM with streams open: exited in {secs:.1f} s, code {code}"))
    await asyncio.wait_for(streams, 60)  # every client must hear the end (finished or an error)
    stop.set()
    await sampling
    return dict(killed_ok=killed_ok, samples=samples, log={" | ".join(k): v for k, v in log.items()}, events=events,
                idle=idle, measured_from=measured_from,
                open_streams={" | ".join(k): v for k, v in open_log.items()})


def wait_idle(server: Server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server.url)
        if m["running"] == m["waiting"] == 0 or time.monotonic() > deadline:
            return dict(m, **resources(server.proc.pid))
        time.sleep(0.5)


def report(result: dict, args) -> bool:
    samples, idle = result["samples"], result["idle"]
    warm = next((s for s in samples if s["t"] >= result["measured_from"]), samples[-1])
    print(f"\nclients {args.clients}, {args.minutes} min, tp={args.tp}, dp={args.dp}, "
          f"KV pool {int(idle['blocks_total'])} blocks, samples every {args.every} s")
    print("\n| requests | count |\n|---|---|")
    for reason, count in sorted(result["log"].items()):
        print(f"| {reason} | {count} |")
    print("\n| when (s) | event |\n|---|---|")
    for t, what in result["events"]:
        print(f"| {t:.0f} | {what} |")
    drift = {k: idle[k] - warm[k] for k in ("rss_mib", "fds", "threads")}
    bounds = {"rss_mib": args.rss_bound, "fds": 16, "threads": 4}
    print("\n| resource | after warm-up | idle after the load | drift | bound |\n|---|---|---|---|---|")
    for k in drift:
        print(f"| {k} | {warm[k]:.0f} | {idle[k]:.0f} | {drift[k]:+.0f} | {bounds[k]} |")
    print(f"| free blocks | | {idle['blocks_free']:.0f} of {idle['blocks_total']:.0f} | | all |")
    print(f"| preemptions | | {idle['preemptions']:.0f} | | |")
    print(f"\nstreams open at SIGTERM: {result['open_streams']}")
    unexplained = [r for r in result["log"] if r.endswith("UNEXPLAINED")]
    ok = (idle["blocks_free"] == idle["blocks_total"] and all(drift[k] <= bounds[k] for k in drift)  # growth
          and not unexplained and sum(result["open_streams"].values()) > 0 and result["killed_ok"] is not False)
    if result["killed_ok"] is False:
        print("after the kill the server did not answer 503 naming the dead process")
    print("PASS" if ok else "FAIL")
    return ok


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [r["t"] for r in s]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    for ax, keys in zip(axes, [("rss_mib",), ("fds", "threads"), ("running", "waiting"), ("blocks_free",)]):
        for k in keys:
            ax.plot(t, [r[k] for r in s], label=k)
        for when, _ in result["events"]:
            ax.axvline(when, color="grey", lw=0.8, ls="--")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("seconds")
    fig.suptitle("bench/soak.py: the server's resources over the run (dashed: faults and restarts)")
    fig.savefig(path, dpi=90, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel engines (> 1: the kill is of engine 1)")
    ap.add_argument("--kv-blocks", type=int, default=64,
                    help="KV pool, in blocks of the embedded model (64: one full-context request fits)")
    ap.add_argument("--kill-at", type=float, default=0.4,
                    help="when to kill a worker or engine, as a fraction of the run")
    ap.add_argument("--every", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--rss-bound", type=float, default=64.0, help="MiB of resident-memory drift allowed")
    ap.add_argument("--out", default="bench/soak")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out + ".png"))
    sys.exit(0 if report(result, args) else 1)


if __name__ == "__main__":
    main()
