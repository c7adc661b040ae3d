# ---
# jupyter:
#   accelerator: GPU
#   colab:
#     gpuType: T4
#     provenance: []
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Serving: an OpenAI-compatible server around the engine
#
# So far we called the engine from Python. A deployed engine sits behind an HTTP API that any client
# can talk to. The layers are kept apart, as in vLLM: an **API server** (FastAPI + uvicorn) parses and
# validates requests and streams answers back as **server-sent events**; an **async engine** owns the
# `LLMEngine` and runs its step loop; the engine itself is the one we have been reading. Requests from
# different clients meet in the engine's waiting queue and are batched together, step by step. The
# server also exports **metrics**: tokens generated, time to first token, time per output token, queue
# depth, KV-cache usage.
#
# This notebook starts the server inside itself (uvicorn in a background thread, on a free port of
# 127.0.0.1), talks to it with the real `openai` client, and stops it at the end.

# %%
# Setup: on Colab, fetch the repository and install it with the server's extras (FastAPI, uvicorn,
# prometheus-client) and the openai client; anywhere else this cell does nothing.
import os
import subprocess
import sys

REPO = "https://github.com/minivllm/minivllm"
if "google.colab" in sys.modules:
    if not os.path.isdir("/content/minivllm"):
        subprocess.run(["git", "clone", "--depth", "1", REPO, "/content/minivllm"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "/content/minivllm[serve]", "openai"],
                   check=True)
    sys.path.insert(0, "/content/minivllm")

# %%
import inspect
import io
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import uvicorn
from matplotlib.figure import Figure
from prometheus_client.parser import text_string_to_metric_families
from pythonjsonlogger.json import JsonFormatter

from minivllm import LLM, EngineConfig, SamplingParams, widgets
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import async_engine, build_app, engine_thread

# %% [markdown]
# ## Two layers: the API server and the engine's owner
#
# `LLMEngine` is not thread-safe, and a step is seconds of CPU-bound work on a big model. So one asyncio
# task owns the engine: HTTP handlers only queue messages for it (add these prompts, abort that request);
# the owner applies them and runs one `step()` on the engine's own thread, while the event loop keeps
# serving connections. Requests that arrive during a step join the batch at the next one. That thread
# is also the one that built the engine: the CPU kernels' OpenMP workers belong to the thread that
# first led them, and a second team on a 2-core machine cost a third of the server's throughput.

# %%
print(async_engine.__doc__)
print(inspect.getsource(async_engine.AsyncEngine._run))
print(engine_thread.__doc__)

# %% [markdown]
# ## Start the server
#
# The engine gets a small limit on how many sequences run at once (`max_num_seqs=4`), so that a burst of
# clients makes a visible queue. The socket is bound before uvicorn starts, to port 0: the operating
# system picks a free port, and it is certainly ours.

# %%
owner = engine_thread.EngineThread()  # builds the engine, then runs every step of it
engine = owner.build(LLMEngine, EngineConfig(max_num_seqs=4, num_kv_blocks=128))
app = build_app(engine, thread=owner)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
thread.start()
deadline = time.monotonic() + 30
while not server.started:
    assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
    time.sleep(0.02)
URL = f"http://127.0.0.1:{port}"
print("serving on", URL)
print(httpx.get(URL + "/health").json(), httpx.get(URL + "/v1/models").json()["data"][0]["id"])

# %% [markdown]
# ## A streamed completion with the `openai` client
#
# Any OpenAI client works: point `base_url` at the server. With `stream=True` each chunk arrives as soon
# as the engine has produced the step's token. Greedy decoding makes the answer checkable: it must equal
# what the offline `LLM` produces for the same prompt.

# %%
client = openai.OpenAI(base_url=URL + "/v1", api_key="none", max_retries=0, timeout=60)
MODEL = client.models.list().data[0].id
prompt = "Once upon a time, there was a little"
t0 = time.perf_counter()
pieces, times = [], []
for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True):
    pieces.append(chunk.choices[0].text)
    times.append(time.perf_counter() - t0)
    print(chunk.choices[0].text, end="", flush=True)
print(f"\n\n{len(pieces)} chunks; first after {times[0] * 1e3:.0f} ms, last after {times[-1] * 1e3:.0f} ms")

offline = LLM(trace_steps=0).generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
assert "".join(pieces) == offline.outputs[0].text, "the server streams exactly what the engine generates"
assert len(pieces) > 1 and times[0] < times[-1], "the text arrived in pieces, not all at once"

# %% [markdown]
# Under the client, the wire format is server-sent events: `data: {json}` lines, one per chunk, and a
# final `data: [DONE]`.

# %%
body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "stream": True}
with httpx.stream("POST", URL + "/v1/completions", json=body) as r:
    lines = [line for line in r.iter_lines() if line]
    content_type = r.headers["content-type"]
print(content_type)
print("\n".join(lines))
assert content_type.startswith("text/event-stream") and lines[-1] == "data: [DONE]"
assert all(line.startswith("data: ") for line in lines)

# %% [markdown]
# ## The request log
#
# Every request leaves one log record per event: `received` (the handler took it), `first_token`
# (with the time spent queued and the time to first token) and `finished` or `aborted` (tokens, timings,
# why it stopped). They are standard `logging` records on the `minivllm.server.requests` logger with their
# fields attached; `minivllm serve --log-format json` prints each as one JSON object, through
# python-json-logger's formatter, as here. The request id is the client's `X-Request-Id` header when it
# sends one (and is echoed back), so a call can be followed from a proxy's logs into the server's.

# %%
log_lines = io.StringIO()
handler = logging.StreamHandler(log_lines)
handler.setFormatter(JsonFormatter("%(asctime)s %(name)s %(message)s"))
request_logger = logging.getLogger("minivllm.server.requests")
request_logger.addHandler(handler)
request_logger.setLevel(logging.INFO)
body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "stream": True}
with httpx.stream("POST", URL + "/v1/completions", json=body, headers={"X-Request-Id": "chapter-09"}) as r:
    echoed = r.headers["x-request-id"]
    chunks = [line for line in r.iter_lines() if line]
deadline = time.monotonic() + 5
while log_lines.getvalue().count("\n") < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
request_logger.removeHandler(handler)
records = [json.loads(line) for line in log_lines.getvalue().splitlines()]
for rec in records:
    print(json.dumps(rec))
assert echoed == "chapter-09" and [rec["event"] for rec in records] == ["received", "first_token", "finished"]
assert all(rec["request_id"] == "chapter-09" for rec in records) and records[-1]["output_tokens"] == 8

# %% [markdown]
# ## Many clients, one batch
#
# Eight clients, each in its own thread with its own connection, start 5 ms apart and stream completions
# of different lengths (16 to 72 tokens). Meanwhile a ninth thread reads `/metrics` every 10 ms. The engine
# runs at most 4 sequences at once: the others wait in the queue, and each joins the batch in the step
# after a running one finishes.


# %%
def metrics() -> dict[str, float]:
    """Every sample of /metrics, by name; labels but model_name (one model here) in braces, as in
    'vllm:request_success_total{finished_reason="abort"}'."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(URL + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def one_client(i: int) -> dict:
    time.sleep(0.005 * i)
    start = time.perf_counter()
    arrivals, text = [], ""
    stream = client.completions.create(model=MODEL, prompt=f"Story {i}: one day, a little", max_tokens=16 + 8 * i,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        arrivals.append(time.perf_counter() - start)
        text += chunk.choices[0].text
    # chunk.id names the call; the engine's request for its one prompt is that id + "-0"
    return {"client": i, "request_id": chunk.id + "-0", "ttft": arrivals[0], "tokens": 16 + 8 * i,
            "last": arrivals[-1], "text": text}


samples, done = [], threading.Event()


def sampler():
    t_start = time.perf_counter()
    while not done.is_set():
        m = metrics()
        samples.append((time.perf_counter() - t_start, m["vllm:num_requests_running"],
                        m["vllm:num_requests_waiting"], m["minivllm:kv_blocks_free"], m["vllm:kv_cache_usage_perc"]))
        time.sleep(0.01)


before = metrics()
first_step = engine.num_steps  # read while the engine is idle; its trace records every step from here
poller = threading.Thread(target=sampler)
poller.start()
t0 = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(one_client, range(8)))
wall = time.perf_counter() - t0
done.set()
poller.join()
after = metrics()
generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
for r in results:
    print(f"client {r['client']}: {r['tokens']:2d} tokens, first after {r['ttft'] * 1e3:5.0f} ms, "
          f"done after {r['last'] * 1e3:5.0f} ms")
print(f"{generated:.0f} tokens in {wall:.2f} s = {generated / wall:.0f} tokens/s across all clients")

# %%
steps = widgets.new_steps(engine, first_step)
batch_sizes = [len(t.scheduled) for t in steps]
most_waiting = max(s[2] for s in samples)
print(f"{len(steps)} engine steps for {generated:.0f} tokens; batch size per step: max {max(batch_sizes)}, "
      f"mean {sum(batch_sizes) / len(batch_sizes):.1f}; longest queue seen in /metrics: {most_waiting:.0f}")
assert generated == sum(r["tokens"] for r in results)
assert max(batch_sizes) == 4 and len(steps) < generated / 2, "clients shared steps: continuous batching"
joined_late = [e.request_id for t in steps[1:] for e in t.scheduled if e.kind == "prefill"]
assert joined_late, "requests were admitted into a batch that was already running"

names = {r["request_id"]: f"client {r['client']}" for r in results}  # the server's ids -> our clients
tl = widgets.timeline(widgets.relabel_requests(steps, names), clock=[t.step - first_step for t in steps])
assert sorted(tl.request_ids) == sorted(names.values())
fig = widgets.timeline_figure(tl, title="8 streaming clients through one engine (max_num_seqs=4)",
                              xlabel="engine step (from the first client's arrival)")
widgets.show(fig)

# %% [markdown]
# Each row is one client's request, each column one engine step: waiting (grey), prefill, decode. As soon
# as a request finishes, a waiting one is prefilled in the next step, alongside the others' decodes.
#
# ## What /metrics said while it ran
#
# The metrics carry vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
# `vllm:time_to_first_token_seconds`, ...) and a `model_name` label, so a Grafana dashboard built for vLLM
# plots them unchanged. The gauges are read from the engine's latest stats at scrape time: sequences
# running and waiting (the queue depth), and the fraction of KV blocks in use. This is what such a
# dashboard would have drawn from the samples taken every 10 ms during the load above.

# %%
fig = Figure(figsize=(9, 2.8))
ax1, ax2 = fig.subplots(1, 2)
ts = [s[0] for s in samples]
ax1.step(ts, [s[1] for s in samples], where="post", label="running")
ax1.step(ts, [s[2] for s in samples], where="post", label="waiting (queue depth)")
ax1.set_xlabel("seconds")
ax1.set_ylabel("sequences")
ax1.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)  # above the lines
total_blocks = after["minivllm:kv_blocks_total"]
ax2.step(ts, [s[4] for s in samples], where="post", color="#c44e52")
ax2.set_xlabel("seconds")
ax2.set_ylabel("vllm:kv_cache_usage_perc")
fig.tight_layout()
widgets.show(fig)
assert max(s[1] for s in samples) <= 4 and most_waiting >= 1, "a queue formed behind the 4 running sequences"

# %% [markdown]
# ## Time to first token and time per output token
#
# Both are Prometheus histograms: cumulative counts per upper bound `le`. Time to first token is
# observed when a request's first token exists (arrival to then: queueing + prefill); time per output
# token when it finishes (the mean gap between its later tokens).

# %%
def histogram(m: dict, name: str) -> list[tuple[float, float]]:
    """(upper bound, count in that bucket alone) from the cumulative Prometheus buckets."""
    cum = sorted((float(re.search(r'le="([^"]+)"', k).group(1)), v) for k, v in m.items()
                 if k.startswith(name + "_bucket"))
    return [(le, c - (cum[i - 1][1] if i else 0)) for i, (le, c) in enumerate(cum)]


fig = Figure(figsize=(9, 2.8))
for ax, name, label in zip(fig.subplots(1, 2), ("vllm:time_to_first_token_seconds",
                                                "vllm:time_per_output_token_seconds"),
                           ("time to first token", "time per output token")):
    buckets = [(le, c) for le, c in histogram(after, name) if le != float("inf")]
    ax.bar(range(len(buckets)), [c for _, c in buckets], color="#4c72b0")
    ax.set_xticks(range(len(buckets)), [f"{le:g}" for le, _ in buckets], rotation=60, fontsize=7)
    ax.set_xlabel("bucket upper bound (s)")
    mean = after[name + "_sum"] / after[name + "_count"]
    ax.set_title(f"{label}: {after[name + '_count']:.0f} requests, mean {mean * 1e3:.0f} ms", fontsize=9)
    print(f"{label}: mean {mean * 1e3:.1f} ms over {after[name + '_count']:.0f} requests")
widgets.show(fig)

# %%
assert after["vllm:time_to_first_token_seconds_count"] == 1 + 1 + 1 + 8, "one observation per request so far"
assert after["vllm:time_per_output_token_seconds_count"] == 1 + 1 + 1 + 8
finished = {re.search(r'"(\w+)"', k).group(1): int(v) for k, v in after.items()
            if k.startswith("vllm:request_success_total")}
print("requests finished, by reason:", finished)
assert sum(finished.values()) == 11 and after["minivllm:kv_blocks_free"] == total_blocks

# %% [markdown]
# ## A client that leaves
#
# A client asks for 300 tokens, reads three chunks and closes the connection. The server notices, aborts
# the request, and its KV blocks return to the free pool at once; the abort is counted.

# %%
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'
stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True})
for n, _ in enumerate(stream):
    if n == 2:
        break
during = metrics()
print(f"while streaming: {during['minivllm:kv_blocks_free']:.0f} of {total_blocks:.0f} blocks free, "
      f"{during['vllm:num_requests_running']:.0f} running")
stream.close()  # the client hangs up
deadline, now = time.monotonic() + 10, during
while time.monotonic() < deadline:
    now = metrics()
    if now.get(ABORTED, 0) >= 1 and now["minivllm:kv_blocks_free"] == now["minivllm:kv_blocks_total"]:
        break
    time.sleep(0.05)
print(f"after it left:   {now['minivllm:kv_blocks_free']:.0f} of {total_blocks:.0f} blocks free, "
      f"{now['vllm:num_requests_running']:.0f} running, {now.get(ABORTED, 0):.0f} aborted")
assert during["minivllm:kv_blocks_free"] < total_blocks and during["vllm:num_requests_running"] == 1
assert now["minivllm:kv_blocks_free"] == now["minivllm:kv_blocks_total"] and now[ABORTED] == 1
assert now["vllm:num_requests_running"] == 0
left_after = now["vllm:generation_tokens_total"] - after["vllm:generation_tokens_total"]
print(f"it received {n + 1} chunks; the engine generated {left_after:.0f} of the 300 tokens asked for")
assert left_after < 300, "it stopped generating for nobody"

# %% [markdown]
# ## Stop the server
#
# uvicorn finishes the open connections, the lifespan hook stops the engine's owner task, and the thread
# ends. After that, the port refuses connections.

# %%
server.should_exit = True
thread.join(10)
sock.close()
print("server thread alive:", thread.is_alive())
assert not thread.is_alive()
try:
    httpx.get(URL + "/health", timeout=2)
    refused = False
except httpx.ConnectError:
    refused = True
assert refused, "nothing listens on the port any more"

# %% [markdown]
# The same server runs from the command line (`python -m minivllm serve --port 8000`), in its own
# process; `bench/serve_load.py` drives it with many concurrent streaming clients and reports requests/s,
# tokens/s, and time-to-first-token and time-per-output-token percentiles.

# %% [markdown]
# ## Exercise: reading the stream
#
# Write the client's side of the wire format: `my_read_events(chunks)` gets the response body as the network
# delivers it, an iterator of `bytes` chunks, and yields each event's JSON as a dict, stopping at
# `data: [DONE]`. An event is `data: ` and a JSON document, ended by a blank line. The network may cut the
# stream anywhere: in the middle of an event, or between the two bytes of an `é`.
#
# **How it works.** Write your version in the next cell (replace `raise NotImplementedError`) and run it, then
# run the checker below it. The checker feeds your reader streams with a known answer, cut at awkward places,
# then starts the real server (`build_app`, uvicorn on a free port) and feeds it the server's own bytes as
# they arrive, and again in 1-3 byte pieces: the text must equal the server's non-streamed completion of the
# same prompt. It says *passed*, *not attempted*, or what failed, in plain words. The reference solution is
# `chapters/solutions/ch09_read_events.py`: try first.

# %%
def my_read_events(chunks):
    raise NotImplementedError  # your code here: yield one dict per event


# %%
from minivllm.exercises.ch09 import check_read_events

check_read_events(my_read_events)

# %% [markdown]
# Next: [10 · A real model](10_real_models.ipynb).
