"""The server's command line (vLLM's flag names): the engine's table (AsyncEngineArgs) plus the HTTP
front end's own flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from minivllm.engine.arg_utils import AsyncEngineArgs


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's flags and then the engine's to `parser`; returns it."""
    srv = parser.add_argument_group("server arguments")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (vLLM's default is every address)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' (default: $VLLM_API_KEY)")
    srv.add_argument("--chat-template", default=None,
                     help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    srv.add_argument("--allowed-origins", type=_origins, default=[],
                     help="CORS origins: a JSON list as in vLLM ('[\"*\"]'), or comma-separated "
                     "(default: none)")
    srv.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                     choices=["debug", "info", "warning", "error", "critical"])
    srv.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="json: one JSON object per log record (request events carry their id)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get after SIGTERM before they are aborted")
    srv.add_argument("--max-request-bytes", type=int, default=4 * 2**20, help="larger get 413")
    srv.add_argument("--max-n", type=int, default=128, help="the largest n a request may ask for "
                     "(at most 128)")
    srv.add_argument("--max-tokens-times-n", type=int, default=2**17, help="the most output tokens "
                     "one request may ask for: max_tokens x n x prompts")
    return AsyncEngineArgs.add_cli_args(parser)


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a path to a file is read; anything else is the template itself."""
    if value is None:
        return None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except OSError:  # a template's text can be too long to be a path
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _origins(text: str) -> list[str]:
    """vLLM's JSON list, or comma-separated names."""
    if text.strip().startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e.msg})") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]
