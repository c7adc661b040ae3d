"""An OpenAI-compatible HTTP server over LLMEngine: `minivllm serve`, or `build_app(engine)` for
your own.

The names below are imported on first use: the engine reads `minivllm.engine.metrics` for
LLM.get_metrics(), and that must not pull FastAPI into every offline script.
"""

from importlib import import_module

__all__ = ["AsyncEngine", "EngineThread", "RequestStream", "build_app", "serve"]
_HOME = {"AsyncEngine": "async_engine", "EngineThread": "engine_thread",
         "RequestStream": "async_engine", "build_app": "app", "serve": "app"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(f"minivllm.server.{_HOME[name]}"), name)
    raise AttributeError(f"module 'minivllm.server' has no attribute {name!r}")
