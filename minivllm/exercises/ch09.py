"""Chapter 09 exercise: reading the server's stream, server-sent events (`data: {json}`, a blank
line after each event, `data: [DONE]` last), as a client must: from network chunks that split
events, and even characters, anywhere.

The checker feeds the reader streams with a known answer, cut at awkward places, then starts the
real server (build_app, uvicorn on a free port) and feeds it the server's own bytes as they arrive,
and again one to three bytes at a time: the text it reassembles must equal the server's
non-streamed completion of the same prompt.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable

from minivllm.config import DEFAULT_MODEL, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.exercises.report import ExerciseFailure, Report, run_checks

EVENTS = [{"text": "Once"}, {"text": " upon a café"}, {"text": "", "finish_reason": "length"}]
WIRE = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
                for e in EVENTS) + b"data: [DONE]\n\n"


def _pieces(data: bytes, sizes: Iterable[int]) -> list[bytes]:
    out, i, sizes = [], 0, iter(sizes)
    while i < len(data):
        n = next(sizes)
        out.append(data[i : i + n])
        i += n
    return out


def _read(read_events: Callable, chunks: Iterable[bytes], how: str, hint: str) -> list:
    try:
        return list(read_events(iter(chunks)))
    except (NotImplementedError, ExerciseFailure):
        raise
    except Exception as error:
        raise ExerciseFailure(f"fed {how}, your reader raised {type(error).__name__}: {error}. "
                              f"{hint}") from None


def _serve() -> tuple[str, Callable[[], None]]:
    """The real server on a free loopback port: its URL and a function that stops it."""
    import uvicorn

    from minivllm.server.app import build_app

    engine = LLMEngine(EngineConfig(DEFAULT_MODEL, max_num_seqs=4, num_kv_blocks=64,
                                    trace_steps=0, device="cpu"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def check_read_events(read_events: Callable) -> Report:
    """Grade `read_events(chunks: Iterator[bytes])`, which yields each event's JSON as a dict and
    stops at `data: [DONE]`."""
    def whole():
        got = _read(read_events, [WIRE], "the stream in one chunk",
                    "Each event is `data: ` and a JSON document; the last is `data: [DONE]`, which "
                    "is no JSON: it says the stream ended, so stop there.")
        if got != EVENTS:
            raise ExerciseFailure(f"fed the stream {WIRE!r} in one chunk, your reader yielded "
                                  f"{got}; the events are {EVENTS} (the JSON after `data: `, "
                                  f"one per blank-line-terminated event, [DONE] not included).")

    def split_events():
        ascii_wire = WIRE.replace("é".encode(), b"e")
        want = json.loads(json.dumps(EVENTS).replace("\\u00e9", "e"))
        for size in (5, 1):
            got = _read(read_events, _pieces(ascii_wire, [size] * len(ascii_wire)),
                        f"the stream in {size}-byte chunks",
                        "The network may cut an event anywhere: keep what came after the last "
                        "blank line in a buffer and finish it with the next chunk.")
            if got != want:
                raise ExerciseFailure(f"fed the stream in {size}-byte chunks, your reader yielded "
                                      f"{got}; the events are {want}: an event ends only at a "
                                      f"blank line, which may arrive in a later chunk.")

    def split_characters():
        got = _read(read_events, _pieces(WIRE, [1] * len(WIRE)), "the stream one byte at a time",
                    "'é' is two bytes in UTF-8 and a chunk may end between them: buffer bytes, "
                    "and decode an event only once it is whole.")
        if got != EVENTS:
            raise ExerciseFailure(f"fed one byte at a time, your reader yielded {got}; the events "
                                  f"are {EVENTS}.")

    def real_server():
        import httpx

        url, stop = _serve()
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 12,
                    "temperature": 0}
            want = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            want = want["choices"][0]["text"]
            raw = []
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                live = _read(read_events, (raw.append(c) or c for c in r.iter_raw()),
                             "the server's stream as it arrived", "")
        finally:
            stop()
        wire = b"".join(raw)
        again = _read(read_events, _pieces(wire, [1, 3, 2] * len(wire)),
                      "the server's stream in 1-3 byte pieces", "")
        for how, events in [("as it arrived", live), ("in 1-3 byte pieces", again)]:
            got = "".join(e["choices"][0]["text"] for e in events)
            if got != want:
                raise ExerciseFailure(f"the real server's stream, read by your reader {how}, "
                                      f"says {got!r}; its non-streamed answer is {want!r}.")

    return run_checks("ch09 read_events", [
        ("a whole stream gives its events, and [DONE] ends it", whole),
        ("events cut across chunks are put together", split_events),
        ("characters cut across chunks are put together", split_characters),
        ("the real server's stream reads back to its non-streamed answer", real_server)])
