"""Issue 28: one hostile request (inside every limit) must not make anyone else wait.

Each row of the issue's table runs, scaled down, against `python -m minivllm serve` in its own
process (so the probes do not share its GIL), while bench/serve_isolation.py's probes time /health
and another client's 1-token completion. The full-size figures are in bench/RESULTS.md.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from bench.serve_isolation import measure
from tests.test_server import MODEL, PROMPT, ServerThread
from tests.test_server_ops import chat_model, serve_process


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, url = serve_process(chat_model(tmp_path_factory, max_position_embeddings=4096),
                              "--log-level", "warning")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def isolated(url: str, row: str, scale: float) -> dict:
    res = measure(url, row, scale, every=0.2)
    assert not res["failures"], res
    assert res["health_probes"] >= 1 and res["completion_probes"] >= 1, res
    assert res["health_worst_s"] < 2 and res["completion_worst_s"] < 5, res
    return res


def test_100k_prompt_lists_row(served):
    res = isolated(served, "prompt_lists", 0.1)  # 10,000 one-token prompts in one call
    assert res["hostile_status"] == [200] and res["choices"] == 10000


def test_prompt_logprobs_rows(served):
    res = isolated(served, "prompt_logprobs_all", 1.0)
    assert res["hostile_status"] == [400] and "max_logprobs of 20" in res["error"]
    # 20 logprobs at each of 500 prompt positions
    res = isolated(served, "prompt_logprobs_max", 0.5)
    assert res["hostile_status"] == [200] and res["logprob_positions"] == 501


def test_two_huge_text_prompts_row(served):
    # two 390 kB texts: tokenized, then longer than the context
    res = isolated(served, "huge_texts", 0.1)
    assert res["hostile_status"] == [400, 400]


def test_many_prompts_streamed_row(served):
    res = isolated(served, "many_prompts_stream", 0.25)  # 5,000 prompts, streamed
    assert res["hostile_status"] == [200] and res["chunks"] == 5000 and res["max_chunk_gap_s"] < 2


def test_same_request_id_twice_at_once(served):
    res = isolated(served, "same_request_id", 1.0)
    assert res["hostile_status"] == [200, 200] and res["response_ids"] == ["cmpl-same-id"] * 2


def test_a_call_enters_the_engine_in_slices_so_a_later_client_overtakes_it(tmp_path_factory):
    """With max_num_seqs=4, a 128-prompt call holds at most 4 sequences in the engine while it is
    alone and 2 once another client arrives, so the other client's request finishes long before the
    big call does (unsliced, it would queue behind all 128 and finish with them)."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import build_app

    engine = LLMEngine(EngineConfig(chat_model(tmp_path_factory), block_size=8, num_kv_blocks=256,
                                    max_model_len=128, max_num_seqs=4, trace_steps=0))
    most = [0]
    real_step = engine.step

    def step():
        most[0] = max(most[0], len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return real_step()

    engine.step = step
    srv = ServerThread(build_app(engine, MODEL))
    url = f"http://127.0.0.1:{srv.port}"
    finished: dict[str, float] = {"start": time.monotonic()}

    def big() -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": [[5, 6]] * 128, "max_tokens": 24,
                                                      "ignore_eos": True},
                       timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 128
        finished["big"] = time.monotonic()

    try:
        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.3)
        sent = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       timeout=60)
        finished["small"] = time.monotonic()
        assert r.status_code == 200
        t.join(120)
        big_took, small_took = finished["big"] - finished["start"], finished["small"] - sent
        assert small_took < big_took / 3, f"the later client waited {small_took:.2f} s of the big call's {big_took:.2f}"
        assert most[0] <= 5, f"{most[0]} sequences queued at once: the call was not sliced"
    finally:
        srv.stop()


def test_slow_clients_get_408_and_are_disconnected(tmp_path_factory):
    """Half a request head, or a Content-Length and half the body, or nothing at all: closed after
    the read timeout (1 s here) with OpenAI's error object, and the server keeps serving."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import build_app
    from minivllm.server.connection import http_protocol

    engine = LLMEngine(EngineConfig(chat_model(tmp_path_factory), block_size=8, num_kv_blocks=64,
                                    max_model_len=64, trace_steps=0))
    srv = ServerThread(build_app(engine, MODEL), http=http_protocol(1.0))
    starts = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
              b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": "]
    try:
        socks = []
        for start in starts:
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(start)
            s.settimeout(10)
            socks.append(s)
        t0 = time.monotonic()
        for s in socks[1:]:
            time.sleep(0.3)
            s.sendall(b" ")  # dribbling does not extend the deadline
        for s in socks:
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            s.close()
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), data
            assert json.loads(body)["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 5
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health").status_code == 200
    finally:
        srv.stop()


def test_malformed_http_is_an_openai_error(tmp_path_factory):
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import build_app
    from minivllm.server.connection import http_protocol

    engine = LLMEngine(EngineConfig(chat_model(tmp_path_factory), block_size=8, num_kv_blocks=64,
                                    max_model_len=64, trace_steps=0))
    srv = ServerThread(build_app(engine, MODEL), http=http_protocol(5.0))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GARBAGE\x00 / HTTP/9\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http"
    finally:
        srv.stop()


def test_a_client_that_hangs_up_while_its_prompts_are_checked_stops_them(tmp_path_factory, monkeypatch):
    """Prompts are checked PROMPTS_PER_JOB at a time: a client gone during the first piece gets no
    second one, and nothing of its call reaches the engine."""
    from minivllm.config import EngineConfig
    from minivllm.engine.input_processor import InputProcessor
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.server import build_app
    from minivllm.server.preprocess import PROMPTS_PER_JOB

    engine = LLMEngine(EngineConfig(chat_model(tmp_path_factory), block_size=8, num_kv_blocks=64,
                                    max_model_len=64, trace_steps=0))
    srv = ServerThread(build_app(engine, MODEL))
    checked, gone, first = [0], threading.Event(), threading.Event()
    real = InputProcessor.process

    def slow_process(self, request_id, *args, **kw):
        checked[0] += 1
        first.set()
        gone.wait(10)
        return real(self, request_id, *args, **kw)

    monkeypatch.setattr(InputProcessor, "process", slow_process)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{srv.port}/v1/completions", timeout=1,
                       json={"prompt": [[5, 6]] * (3 * PROMPTS_PER_JOB), "max_tokens": 1})
        assert first.is_set()
        time.sleep(0.3)  # the server hears of the hang-up
        gone.set()
        time.sleep(1)
        assert checked[0] == PROMPTS_PER_JOB, f"{checked[0]} prompts checked after the client left"
        assert engine.stats()["num_waiting"] == engine.stats()["num_running"] == 0
        assert engine.num_steps == 0
    finally:
        gone.set()
        srv.stop()


def test_max_logprobs_flag_reaches_the_engine(monkeypatch):
    import minivllm.server
    from minivllm.__main__ import main

    got = {}
    monkeypatch.setattr(minivllm.server, "serve", lambda *a, **kw: got.update(kw))
    assert main(["serve", "--max-logprobs", "-1"]) == 0 and got["engine_config"].max_logprobs == -1
    assert main(["serve"]) == 0 and got["engine_config"].max_logprobs == 20  # vLLM's default
