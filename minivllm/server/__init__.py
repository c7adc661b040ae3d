"""An OpenAI-compatible HTTP server over LLMEngine: `minivllm serve`, or `build_app(engine)` for your own."""

from minivllm.server.app import build_app, serve
from minivllm.server.async_engine import AsyncEngine, RequestStream

__all__ = ["AsyncEngine", "RequestStream", "build_app", "serve"]
