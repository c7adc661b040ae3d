"""OpenAI's batch format, offline: `python -m minivllm.entrypoints.openai.run_batch -i IN -o OUT`.

Each input line is one request (`custom_id`, `method`, `url`, `body`); each output line, in input
order, holds what the server would have answered, because every line goes through the server's own
routes in process (httpx's ASGI transport, no socket), concurrently, sharing the running batch as
HTTP clients do. A malformed line gets `response: null` and an `error`: it stops no other."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.llm_engine import LLMEngine

URLS = ("/v1/completions", "/v1/chat/completions")


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _invalid(custom_id: Any, message: str) -> dict:
    return {"id": _id("minivllm"), "custom_id": custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def parse_line(line: str) -> tuple[dict | None, dict | None]:
    """(request, None) for a well-formed line, else (None, an output line saying what is wrong)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        return None, _invalid(None, f"not valid JSON: {e.msg}")
    if not isinstance(item, dict):
        return None, _invalid(None, "each line must be a JSON object")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    method = item.get("method", "POST")
    checks = [  # (what is wrong, what to say), the first that holds is said
        (not isinstance(custom_id, str), "custom_id must be a string"),
        (method != "POST", f"method must be POST, got {method!r}"),
        (url not in URLS, f"url {url!r} is not supported: use one of {list(URLS)}"),
        (not isinstance(body, dict), "body must be a JSON object (the request)"),
        (isinstance(body, dict) and body.get("stream"),
         "a batch request must not stream (stream=true)")]
    why = next((message for wrong, message in checks if wrong), None)
    return (None, _invalid(custom_id, why)) if why else (item, None)


async def run_batch(engine: LLMEngine, lines: Sequence[str], model_name: str | None = None,
                    max_concurrency: int | None = None) -> list[dict]:
    """The output line for each input line, in order. `model_name`: what the lines' "model" must be
    (default: the served model name); `max_concurrency`: requests in flight (2 x max_num_seqs)."""
    import httpx

    from minivllm.server import build_app

    app = build_app(engine, model_name)
    limit = asyncio.Semaphore(max_concurrency or 2 * engine.config.max_num_seqs)

    async def one(client: httpx.AsyncClient, line: str) -> dict:
        item, bad = parse_line(line)
        if bad is not None:
            return bad
        async with limit:
            response = await client.post(item["url"], json=item["body"])
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text, "code": response.status_code}}
        failed = response.status_code >= 400 and isinstance(body, dict)
        request_id = response.headers.get("x-request-id", _id("minivllm-batch"))
        return {"id": _id("minivllm"), "custom_id": item["custom_id"],
                "response": {"status_code": response.status_code, "request_id": request_id,
                             "body": body}, "error": body.get("error") if failed else None}

    async with app.router.lifespan_context(app):  # starts and stops the engine's owner task
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://minivllm",
                                     timeout=None) as client:
            return list(await asyncio.gather(*(one(client, line) for line in lines
                                               if line.strip())))


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch runner's flags, then the engine's (vLLM's names, from AsyncEngineArgs)."""
    parser.add_argument("-i", "--input-file", required=True,
                        help="the requests, one JSON object per line")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the results go, one line per request")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: 2 x --max-num-seqs)")
    return AsyncEngineArgs.add_cli_args(parser)


def main(argv: list[str] | None = None) -> int:
    parser = make_arg_parser(argparse.ArgumentParser(
        prog="python -m minivllm.entrypoints.openai.run_batch",
        description="Run a file of OpenAI requests offline."))
    args = parser.parse_args(argv)
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        lines = Path(args.input_file).read_text(encoding="utf-8").splitlines()
        engine = LLMEngine.from_engine_args(engine_args)
        results = asyncio.run(run_batch(engine, lines, max_concurrency=args.max_concurrency))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.output_file).write_text("".join(json.dumps(r) + "\n" for r in results),
                                      encoding="utf-8")
    failed = sum(r["error"] is not None for r in results)
    print(f"{len(results)} requests, {failed} failed: {args.output_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
