"""`minivllm serve -dp 2` (server/data_parallel.py), driven by the real `openai` client.

Each test runs the server as `python -m minivllm serve` in a subprocess over test_server's tiny chat
model, the way an operator would, so that the engine processes, their failures and the shutdown
are real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.server_process import start_server, stop_server
from tests.test_server_ops import chat_model

PROMPTS = [f"The quick brown fox {i}" for i in range(6)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory, max_position_embeddings=2048)  # room for long streams


@pytest.fixture
def serve(ckpt, tmp_path):
    """Start `minivllm serve` with these flags; yields (process, openai client, url); stops it."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, openai.OpenAI, str]:
        proc, url = start_server(ckpt, "--num-kv-blocks", "256", "--dtype", "float32", "--served-model-name",
                                 "tiny-chat", *args, env={"MINIVLLM_WEIGHT_CACHE_DIR": str(tmp_path)},
                                 deadline_s=120)
        started.append(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        return proc, client, url

    yield start
    for proc in started:
        stop_server(proc)


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def greedy(client: openai.OpenAI) -> list[str]:
    """Every prompt at once from its own thread, so both engines get some; texts in prompt order."""
    texts: list[str | Exception] = [""] * len(PROMPTS)

    def one(i: int) -> None:
        try:
            texts[i] = client.completions.create(model="tiny-chat", prompt=PROMPTS[i],
                                                 max_tokens=12, temperature=0).choices[0].text
        except openai.APIError as e:
            texts[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts


def test_dp2_equals_dp1_streams_n_metrics_and_leaves_no_process(serve):
    _, client, _ = serve()
    want = greedy(client)
    proc, client, url = serve("-dp", "2")
    assert len(engines(proc.pid)) == 1  # engine 1 runs in its own process
    assert greedy(client) == want
    stream = client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == want[0]
    many = client.completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=5, n=3,
                                     temperature=1, seed=0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(url + "/metrics").text
    total = [line for line in metrics.splitlines() if line.startswith("minivllm:kv_blocks_total")]
    assert total and float(total[0].split()[-1]) == 2 * 256  # both engines' blocks
    kids = children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while alive := [k for k in kids if _running(k)]:
        assert time.monotonic() < deadline, f"processes {alive} outlived the server"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_engine_is_an_error_naming_it_not_a_hang(serve):
    proc, client, url = serve("-dp", "2")
    (engine1,) = engines(proc.pid)
    os.kill(engine1, signal.SIGKILL)
    while not _exited(engine1):  # killed, maybe reaped by the server's watcher already
        time.sleep(0.05)
    errors = []
    for prompt in PROMPTS[:2]:  # whichever engine a call would go to, it is refused now
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4)
        errors.append(e.value)
    assert all(e.status_code == 503 for e in errors)
    assert all("engine 1" in e.message and "exited" in e.message for e in errors), errors[0].message
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "engine 1" in health.json()["error"]


def test_an_engine_killed_mid_stream_ends_the_stream_with_its_error(serve):
    proc, client, _ = serve("-dp", "2")
    (engine1,) = engines(proc.pid)
    # two long streams at once: least-loaded puts one on each engine
    streams = [client.completions.create(model="tiny-chat", prompt=p, max_tokens=1500, stream=True,
                                         extra_body={"ignore_eos": True}) for p in PROMPTS[:2]]
    firsts = [next(iter(s)) for s in streams]
    assert all(f.choices for f in firsts)
    os.kill(engine1, signal.SIGKILL)
    outcomes = []
    for s in streams:
        try:
            for _ in s:
                pass
            outcomes.append("finished")
        except openai.APIError as e:
            outcomes.append(str(e))
    assert "finished" in outcomes  # engine 0's stream is not disturbed
    assert any("engine 1" in o for o in outcomes), outcomes


def _exited(pid: int) -> bool:
    """Whether the kernel is done with `pid`: gone, or a zombie with no thread left but its leader.
    Not "Z" alone: a killed multi-threaded process shows its leader as a zombie while its other
    threads are still exiting, and until they are gone nobody can read its exit (session 10's
    intermittent failure of the test below was this test asking too early)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def engines(pid: int) -> list[int]:
    """The server's engine processes (spawned children; not multiprocessing's resource tracker)."""
    out = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(child)
        except OSError:
            pass
    return out
