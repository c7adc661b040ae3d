"""The server for operators (issue 17): limits, keys, CORS, vLLM's endpoints and names, shutdown,
fuzzing.

Reuses test_server's tiny chat model and in-process server thread; the shutdown tests run `python -m
minivllm serve` in a subprocess on a free loopback port and send it real signals.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

import minivllm
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server.limits import ServerLimits
from tests.conftest import build_checkpoint
from tests.server_process import start_server
from tests.test_server import MODEL, PROMPT, ServerThread, write_tokenizer

KEY = "s3cret-key"


def chat_model(tmp_path_factory, **overrides):
    """test_server's tiny chat model (its tokenizer and ChatML template), with config overrides."""
    path = tmp_path_factory.mktemp("server_ops") / MODEL
    path.mkdir()
    vocab = write_tokenizer(path)
    build_checkpoint("llama", path, vocab_size=vocab, eos_token_id=vocab - 1, **overrides)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory)


def start(ckpt, **kw) -> ServerThread:
    from minivllm.server import build_app

    engine = LLMEngine(EngineConfig(ckpt, block_size=8, num_kv_blocks=256, max_model_len=128,
                                    trace_steps=0))
    srv = ServerThread(build_app(engine, MODEL, **kw))
    srv.url, srv.engine = f"http://127.0.0.1:{srv.port}", engine
    return srv


@pytest.fixture(scope="module")
def ops(ckpt):
    srv = start(ckpt, limits=ServerLimits(max_request_bytes=64 * 1024, max_n=8,
                                          max_tokens_times_n=512),
                allowed_origins=["http://app.example"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(ckpt):
    srv = start(ckpt, api_key=KEY)
    yield srv
    srv.stop()


def err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- bad input the issue found -------------------------------------------------------------------
def test_lone_surrogate_is_a_400_on_both_endpoints_and_the_connection_survives(ops):
    raw = '"hi \\ud800"'  # JSON's escape for a lone surrogate: valid JSON, invalid Unicode
    bodies = {"/v1/completions": f'{{"prompt": {raw}, "max_tokens": 2}}',
              "/v1/chat/completions": f'{{"messages": [{{"role": "user", "content": {raw}}}], "max_tokens": 2}}'}
    # one keep-alive connection for every call
    with httpx.Client(base_url=ops.url, timeout=10) as c:
        ports = set()
        for path, body in bodies.items():
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            e = err(r, 400)
            assert "surrogate" in e["message"] and e["param"] in ("prompt", "messages")
            r = c.post(path, json=json.loads(body.replace(raw, '"hi"')))
            assert r.status_code == 200, r.text
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(ports) == 1, "the keep-alive connection was reused, not dropped"


def test_unknown_model_is_404(ops):
    e = err(httpx.post(ops.url + "/v1/completions", json={"model": "gpt-7", "prompt": PROMPT}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model" and "gpt-7" in e["message"]
    err(httpx.get(ops.url + "/v1/models/gpt-7"), 404)
    assert httpx.get(f"{ops.url}/v1/models/{MODEL}").json()["id"] == MODEL


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_out_of_range_names_seed(ops, seed):
    assert err(httpx.post(ops.url + "/v1/completions", json={"prompt": PROMPT, "seed": seed}),
               400)["param"] == "seed"


def test_asking_for_more_than_the_context_is_a_400_not_a_silent_cap(ops):
    e = err(httpx.post(ops.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 127}),
            400)
    assert e["param"] == "max_tokens" and "128" in e["message"]
    r = httpx.post(ops.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2})
    assert r.status_code == 200  # chat without max_tokens still means "up to the context"


def test_n_and_total_token_caps(ops):
    assert err(httpx.post(ops.url + "/v1/completions", json={"prompt": PROMPT, "n": 50000}),
               400)["param"] == "n"
    assert err(httpx.post(ops.url + "/v1/completions", json={"prompt": PROMPT, "n": 9}),
               400)["param"] == "n"
    e = err(httpx.post(ops.url + "/v1/completions",
                       json={"prompt": PROMPT, "n": 8, "max_tokens": 100}), 400)
    assert "512" in e["message"]
    r = httpx.post(ops.url + "/v1/completions", json={"prompt": PROMPT, "n": 8, "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_request_body_cap_is_413(ops):
    big = {"prompt": "fox " * 20000, "max_tokens": 1}  # 80 kB > 64 KiB
    e = err(httpx.post(ops.url + "/v1/completions", json=big), 413)
    assert e["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(ops.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    err(r, 413)
    assert httpx.get(ops.url + "/health").status_code == 200


def test_a_huge_prompt_does_not_stall_other_streams(ckpt, monkeypatch):
    """Tokenizing runs in the preprocess pool: while one request's tokenization is stuck, others
    still stream."""
    from minivllm.tokenizer import Tokenizer

    srv = start(ckpt)
    release, stuck = threading.Event(), threading.Event()
    real = Tokenizer.encode

    def slow_encode(self, text):
        if text.startswith("HUGE"):
            stuck.set()
            assert release.wait(30)
        return real(self, text)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)
    try:
        t = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                             kwargs={"json": {"prompt": "HUGE " + PROMPT, "max_tokens": 1},
                                     "timeout": 30})
        t.start()
        assert stuck.wait(10)
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}, timeout=10)
        assert (r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
                and not release.is_set())
    finally:
        release.set()
        t.join(10)
        srv.stop()


# ---- keys, CORS, HTTP details --------------------------------------------------------------------
def test_api_key(keyed):
    e = err(httpx.post(keyed.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}),
            401)
    assert e["type"] == "authentication_error"
    err(httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    err(httpx.post(keyed.url + "/tokenize", json={"prompt": "hi"}), 401)
    ok = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(keyed.url + path).status_code == 200, path


def test_api_key_from_environment():
    from minivllm.server.limits import resolve_api_key

    assert resolve_api_key(None, "from-env") == "from-env"
    assert resolve_api_key("flag", "from-env") == "flag"
    assert resolve_api_key(None, "") is None and resolve_api_key(None, None) is None


def test_cors_preflight_and_allow_header(ops):
    pre = httpx.options(ops.url + "/v1/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert (pre.status_code == 200
            and pre.headers["access-control-allow-origin"] == "http://app.example")
    other = httpx.options(ops.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    e = err(other, 400)  # refused in OpenAI's shape, not Starlette's plain text
    assert e["code"] == "cors_refused" and "origin" in e["message"]
    r = httpx.get(ops.url + "/v1/completions")
    assert err(r, 405) and r.headers["allow"] == "POST"
    assert err(httpx.options(ops.url + "/ping"), 405) and httpx.options(ops.url + "/ping").headers["allow"] == \
        "GET, POST"  # every method the path has, not its first route's
    e = err(httpx.post(ops.url + "/v1/completions", content=b'{"prompt": "\xff"}',
                       headers={"content-type": "application/json"}), 400)
    assert "UTF-8" in e["message"] and e["code"] == "invalid_json"
    e = err(httpx.post(ops.url + "/v1/completions", content=b"[" * 10000,
                       headers={"content-type": "application/json"}),
            400)
    assert "nested too deeply" in e["message"]


# ---- vLLM's endpoints ----------------------------------------------------------------------------
def test_tokenize_detokenize_version_ping(ops):
    r = httpx.post(ops.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert set(r) >= {"count", "max_model_len", "tokens"} and r["count"] == len(r["tokens"]) > 0
    assert r["max_model_len"] == 128
    assert httpx.post(ops.url + "/detokenize",
                      json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    chat = httpx.post(ops.url + "/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    usage = httpx.post(ops.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"], "tokenize counts what chat would send"
    assert err(httpx.post(ops.url + "/detokenize", json={"tokens": [10**9]}),
               400)["param"] == "tokens"
    assert err(httpx.post(ops.url + "/tokenize", json={"prompt": "x", "model": "nope"}), 404)
    assert httpx.get(ops.url + "/version").json() == {"version": minivllm.__version__}
    assert (httpx.get(ops.url + "/ping").json() == {"status": "ok"}
            and httpx.post(ops.url + "/ping").status_code == 200)


def test_openapi_documents_400_not_422(ops):
    spec = httpx.get(ops.url + "/openapi.json").json()
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "413"):
        assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"/tokenize", "/detokenize", "/version", "/ping",
            "/v1/models/{model_id}"} <= set(spec["paths"])


# ---- shutdown, in a real process -----------------------------------------------------------------
@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """The chat model with room for 4096 positions, so streams outlast the shutdown timeout whatever
    the load."""
    return chat_model(tmp_path_factory, max_position_embeddings=4096)


def serve_process(ckpt, *args: str) -> tuple[subprocess.Popen, str]:
    """`minivllm serve` with room for long streams (1024 blocks, 4096 positions) and `args`."""
    return start_server(ckpt, "--num-kv-blocks", "1024", "--max-model-len", "4096", *args)


def open_streams(url: str, count: int, max_tokens: int,
                 first: threading.Barrier) -> list[list[str]]:
    """`count` streaming clients, each in a thread; returns their data lines once all have ended."""
    results: list[list[str]] = [[] for _ in range(count)]

    def one(i: int) -> None:
        body = {"prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for n, line in enumerate(line for line in r.iter_lines() if line):
                    results[i].append(line)
                    if n == 0:
                        first.wait(30)
        except httpx.HTTPError as e:
            results[i].append(f"error: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    results.append(threads)  # type: ignore[arg-type]
    return results


def test_sigterm_waits_shutdown_timeout_then_aborts_streams_and_exits_0(long_ckpt):
    proc, url = serve_process(long_ckpt, "--shutdown-timeout", "1.5", "--log-format", "json")
    started = threading.Barrier(5)
    try:
        results = open_streams(url, 4, 4000, started)  # far longer than the 1.5 s they get
        threads = results.pop()
        started.wait(30)  # every stream has its first chunk
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            time.sleep(0.5)
            httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=2)
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert 1.4 < took < 15, (took, out)
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][6:])
        assert last["choices"][0]["finish_reason"] == "abort", lines[-3:]
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sum(r.get("event") == "aborted" for r in records) == 4, out[-2000:]
    freed = [r["message"] for r in records if r["message"].startswith("engine stopped")]
    assert freed == ["engine stopped: 1024 of 1024 KV blocks free"], out[-2000:]


def test_a_second_signal_exits_at_once(long_ckpt):
    proc, url = serve_process(long_ckpt, "--shutdown-timeout", "60")
    started = threading.Barrier(3)
    try:
        results = open_streams(url, 2, 4000, started)
        threads = results.pop()
        started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None, "the first signal waits for the streams"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode()
    assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]
    # the engine still stops cleanly
    assert "engine stopped: 1024 of 1024 KV blocks free" in out, out[-3000:]
