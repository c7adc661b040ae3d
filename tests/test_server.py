"""The OpenAI-compatible server, driven by the real `openai` client over loopback.

The server runs in a background thread (uvicorn on a pre-bound socket) over a tiny random Llama with
a tiny byte-level BPE tokenizer and a ChatML template trained here, so nothing depends on the
embedded model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from tests.conftest import build_checkpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
          "endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = "tiny-chat"
PROMPT = "The quick brown fox"


def write_tokenizer(path) -> int:
    """Train a byte-level BPE on a few sentences and save it with a chat template; returns its
    size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you today?",
              "Paged attention stores keys and values in blocks.", "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   chat_template=CHATML)
    fast.save_pretrained(path)
    return len(fast)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / MODEL
    path.mkdir()
    vocab = write_tokenizer(path)
    build_checkpoint("llama", path, vocab_size=vocab, eos_token_id=vocab - 1)
    return path


class ServerThread:
    """uvicorn in a daemon thread, on a socket bound before it starts (so the port is certainly
    ours)."""

    def __init__(self, app, **config) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=1,
                                                   **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert (time.monotonic() < deadline
                    and self.thread.is_alive()), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(chat_ckpt):
    from minivllm.server import build_app

    engine = LLMEngine(EngineConfig(chat_ckpt, block_size=8, num_kv_blocks=1024, max_model_len=256,
                                    trace_steps=0))
    app = build_app(engine, MODEL)
    srv = ServerThread(app)
    srv.url = f"http://127.0.0.1:{srv.port}"
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def offline(chat_ckpt):
    return LLM(chat_ckpt, block_size=8, num_kv_blocks=256, trace_steps=0)


def metrics(url: str, model: str = MODEL) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client, by name; labels other than model_name
    (which must be the served model's) in braces, e.g.
    'vllm:request_success_total{finished_reason="abort"}'."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if not s.name.startswith(("vllm:", "minivllm:")):
                continue
            assert s.labels.get("model_name") == model, s
            labels = ",".join(f'{k}="{v}"' for k,
                              v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def greedy(**kw) -> dict:
    return {"temperature": 0.0, **kw}


# ---- the happy paths -----------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_offline_greedy(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **greedy())
    choice = resp.choices[0]
    assert (choice.text == ref.outputs[0].text
            and choice.finish_reason == ref.outputs[0].finish_reason)
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_equals_offline_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **greedy())
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_equals_non_streaming(client, chat):
    kw = dict(model=MODEL, max_tokens=30, ignore_eos=True, **greedy())
    if chat:
        create = (lambda **x: client.chat.completions.create(messages=[{"role": "user",
                                                                        "content": PROMPT}], **x))
        text_of = lambda ch: ch.message.content
        delta_of = lambda ch: ch.delta.content or ""
    else:
        create = lambda **x: client.completions.create(prompt=PROMPT, **x)
        text_of = lambda ch: ch.text
        delta_of = lambda ch: ch.text
    kw["extra_body"] = {"ignore_eos": kw.pop("ignore_eos")}
    full = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len(chunks) > 3, "tokens arrive as they are generated, not in one piece"
    text = "".join(delta_of(c.choices[0]) for c in chunks if c.choices)
    assert text == text_of(full.choices[0])
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices
               and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.completion_tokens == 30


def test_raw_sse_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert (first["object"] == "text_completion"
            and "usage" not in first), "usage only with include_usage"


def test_stop_string_is_never_streamed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True},
              **greedy())
    text = client.completions.create(**kw).choices[0].text
    stop = text[10:14]  # several characters, so it spans tokens and only shows up as a whole later
    assert len(stop) == 4
    expect = text[: text.find(stop)]
    full = client.completions.create(stop=[stop], **kw).choices[0]
    assert (full.text, full.finish_reason) == (expect, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True,
                                                                            **kw))
    assert streamed == expect


def test_prompt_lists_token_ids_and_n(client, offline):
    ids = offline.tokenizer.encode("Hello there")
    resp = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello there"], max_tokens=6, n=2,
                                     extra_body={"ignore_eos": True}, **greedy())
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                       extra_body={"ignore_eos": True}, **greedy())
    assert resp.choices[2].text == resp.choices[3].text == by_ids.choices[0].text, "greedy: n copies agree"
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT)) + len(ids)
    assert resp.usage.completion_tokens == 4 * 6
    seeded = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                        seed=7).choices[0]
              .text for _ in range(2)]
    assert seeded[0] == seeded[1], "a seed makes sampling repeatable"


def slow_steps(monkeypatch, engine: LLMEngine, seconds: float) -> threading.Event:
    """Make every engine step take `seconds` longer; the event is set once one has started."""
    real_step, stepping = engine.step, threading.Event()

    def slow_step():
        stepping.set()
        time.sleep(seconds)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    return stepping


def test_a_slow_step_does_not_block_the_event_loop(server, monkeypatch):
    """Steps run in a worker thread: while one is stuck inside engine.step(), the server still
    answers."""
    real_step, stepping, release = server.engine.step, threading.Event(), threading.Event()

    def stuck_step():
        stepping.set()
        assert release.wait(30), "the test never released the step"
        return real_step()

    monkeypatch.setattr(server.engine, "step", stuck_step)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    done = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                            kwargs={"json": body})
    done.start()
    assert stepping.wait(10)
    try:
        # the step cannot finish before `release` is set, so this answer proves the loop is free
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert not release.is_set()
    finally:
        release.set()
        done.join(10)


def test_request_events_are_logged_with_the_client_request_id(server, caplog):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.INFO, logger="minivllm.server.requests"):
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers={"X-Request-Id": "trace-42"}) as r:
            assert r.headers["x-request-id"] == "trace-42"
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deadline = time.monotonic() + 2
        while not any(getattr(x, "event", None) == "finished"
                      for x in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert chunks[0]["id"] == "cmpl-trace-42"
    events = [x for x in caplog.records if getattr(x, "request_id", None) == "trace-42"]
    assert [e.event for e in events] == ["received", "first_token", "finished"]
    received, first, finished = events
    assert (received.stream is True and received.max_tokens == 4
            and received.endpoint == "/v1/completions")
    assert finished.output_tokens == 4 and finished.finish_reason == "length"
    assert 0 < first.ttft_s == finished.ttft_s <= finished.total_s
    assert "finished trace-42" in finished.getMessage(), "the default format stays readable"
    # a fresh id when the client sends none (or a silly one), echoed back all the same
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                   headers={"X-Request-Id": "bad id\twith spaces"})
    fresh = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh) and r.json()["id"].endswith(fresh)


def test_a_failing_step_gives_503s_instead_of_hanging(chat_ckpt):
    from minivllm.server import build_app

    engine = LLMEngine(EngineConfig(chat_ckpt, num_kv_blocks=64, trace_steps=0))

    def broken_step():
        raise RuntimeError("the model fell over")

    engine.step = broken_step
    srv = ServerThread(build_app(engine, MODEL))
    url = f"http://127.0.0.1:{srv.port}"
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                       timeout=10)
        assert r.status_code == 503 and "the model fell over" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503
        r = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        srv.stop()


def test_every_step_runs_on_the_thread_that_built_the_engine(chat_ckpt):
    """OpenMP gives each thread that leads a parallel region its own team of workers: a model
    loaded on one thread and stepped on others runs slower (engine_thread.py). So `serve` builds
    the engine on an EngineThread and every step, of every request, runs there."""
    from minivllm.server import build_app
    from minivllm.server.engine_thread import EngineThread

    thread = EngineThread()
    engine = thread.build(LLMEngine, EngineConfig(chat_ckpt, num_kv_blocks=64, trace_steps=0))
    builder, steppers, real_step = thread.build(threading.get_ident), set(), engine.step

    def step():
        steppers.add(threading.get_ident())
        return real_step()

    engine.step = step
    srv = ServerThread(build_app(engine, MODEL, thread=thread))
    url = f"http://127.0.0.1:{srv.port}"
    try:
        bodies = [{"prompt": PROMPT, "max_tokens": 4, "stream": i % 2 == 0} for i in range(6)]
        with httpx.Client(timeout=30) as http:
            threads = [threading.Thread(target=http.post, args=(url + "/v1/completions",),
                                        kwargs={"json": b}) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        srv.stop()
    assert builder != threading.get_ident() and steppers == {builder}


# ---- many clients at once ------------------------------------------------------------------------
def test_32_concurrent_streams_some_disconnecting(server):
    """Everyone streams at once; 12 leave after 3 chunks. Those are aborted, and every block comes
    back."""
    before = metrics(server.url)
    steps_before = server.engine.num_steps
    max_tokens, long_tokens = 24, 200

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, str | None, int]:
        leaves = i % 8 < 3
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=long_tokens if leaves else max_tokens,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks, reason, tokens = 0, None, -1
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            if leaves and chunks == 3:
                await stream.close()
                return i, "left", tokens
        return i, reason, tokens

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(run())
    left = [r for r in results if r[1] == "left"]
    stayed = [r for r in results if r[1] != "left"]
    assert len(left) == 12 and len(stayed) == 20
    assert all(reason == "length" and tokens == max_tokens for _, reason, tokens in stayed)

    deadline, after = time.monotonic() + 5, {}
    while time.monotonic() < deadline:
        after = metrics(server.url)
        if after["minivllm:kv_blocks_free"] == after["minivllm:kv_blocks_total"] and \
                after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    assert after["minivllm:kv_blocks_free"] == after["minivllm:kv_blocks_total"] > 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert (after.get(aborted, 0) - before.get(aborted,
                                               0) == 12), "every client that left was aborted"
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 20 * max_tokens <= generated < 20 * max_tokens + 12 * long_tokens
    steps = server.engine.num_steps - steps_before
    assert steps < generated / 4, f"{steps} steps for {generated} tokens: clients were not batched together"


def test_client_leaving_a_non_streaming_request_aborts_it(server, monkeypatch):
    slow_steps(monkeypatch, server.engine, 0.05)  # 200 tokens would now take over 10 s
    before = metrics(server.url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    deadline, after = time.monotonic() + 5, before
    key = 'vllm:request_success_total{finished_reason="abort"}'
    while time.monotonic() < deadline and after.get(key, 0) == before.get(key, 0):
        time.sleep(0.05)
        after = metrics(server.url)
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["minivllm:kv_blocks_free"] == after["minivllm:kv_blocks_total"]


def test_metrics_exposition_uses_vllm_names(server):
    families = ({f.name: f
                 for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)})
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:time_per_output_token_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram", "vllm:prompt_tokens": "counter",
             "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
             "vllm:num_preemptions": "counter",
             "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
             "minivllm:kv_blocks_total": "gauge", "minivllm:kv_blocks_free": "gauge"}
    for name, kind in kinds.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels["model_name"] == MODEL for s in families[name].samples), name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    m = metrics(server.url)
    assert (m["vllm:time_to_first_token_seconds_count"] > 0
            and m["vllm:time_to_first_token_seconds_sum"] > 0)
    assert m["vllm:e2e_request_latency_seconds_count"] > 0 and m["vllm:prompt_tokens_total"] > 0
    assert m["minivllm:kv_blocks_total"] == 1024 and 0 <= m["vllm:kv_cache_usage_perc"] <= 1


# ---- bad requests --------------------------------------------------------------------------------
BAD = [
    ("completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens", "integer"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", ">= 1"),
    ("completions", {"prompt": PROMPT, "temperature": -1}, "temperature", ">= 0"),
    ("completions", {"prompt": PROMPT, "n": True}, "n", "integer"),
    ("completions", {"prompt": "fox " * 400}, "prompt", "max_model_len"),
    ("completions", {"prompt": [5, 99999]}, "prompt", "vocabulary"),
    ("completions", {"prompt": ""}, "prompt", "empty"),
    ("completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", "20"),
    ("completions", {"prompt": PROMPT, "suffix": "!"}, "suffix", "not supported"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"x": 1.0}}, "logit_bias", "token ids"),
    ("completions", {"prompt": PROMPT, "guided_regex": "(", "guided_choice": ["a"]}, "guided_regex",
     "one"),
    ("completions", {"prompt": PROMPT, "guided_regex": "(unclosed"}, "structured_outputs", "regex"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs", "logprobs: true"),
    ("completions", {"max_tokens": 3}, "prompt", "required"),
    ("completions", {"prompt": PROMPT, "stop": 5}, "stop", "string"),
    ("chat/completions", {"messages": "hi"}, "messages", "list"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages", "robot"),
    ("chat/completions", {"messages": []}, "messages", "empty"),
]


@pytest.mark.parametrize("route,body,param,words", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_requests_get_openai_400s(server, route, body, param, words):
    r = httpx.post(f"{server.url}/v1/{route}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_invalid_json_and_the_server_keeps_serving(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",',
                   headers={"content-type":
                                                                                      "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert client.completions.create(model=MODEL, prompt=PROMPT,
                                     max_tokens=3).usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    assert metrics(server.url)["minivllm:kv_blocks_free"] == 1024


def test_cli_serve_subprocess(chat_ckpt):
    """`python -m minivllm serve` starts, answers, and exits cleanly on Ctrl-C."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--model", str(chat_ckpt),
                             "--port",
                             str(port), "--num-kv-blocks", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 45
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == str(chat_ckpt)  # vLLM's rule: the model exactly as given
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": str(chat_ckpt), "prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0, proc.stdout.read().decode()
