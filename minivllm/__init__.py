"""minivllm: a compact vLLM-style inference engine, written to be read.

The names below load on first use (as vLLM's own `__init__` does): `from minivllm import LLM`
imports the engine, while `import minivllm.core.scheduler` loads only the plain-Python core, without
torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any


def _version() -> str:
    """The installed distribution's version (a checkout never installed has none)."""
    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:
        return "0+unknown"


MODULE_ATTRS = {  # name -> the module that defines it
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineArgs": "minivllm.engine.arg_utils",
    "AsyncEngineArgs": "minivllm.engine.arg_utils",
    "EngineConfig": "minivllm.config",
    "EngineHooks": "minivllm.hooks",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "BeamSearchParams": "minivllm.engine.beam_search",
    "BeamSearchOutput": "minivllm.engine.beam_search",
    "BeamSearchSequence": "minivllm.engine.beam_search",
}
__all__ = ["LLM", "LLMEngine", "EngineArgs", "AsyncEngineArgs", "EngineConfig", "EngineHooks",
           "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams",
           "BeamSearchOutput",
           "BeamSearchSequence"]  # = MODULE_ATTRS' names (tests/test_layers.py checks)
__version__ = _version()  # pyproject.toml's, as installed (the one place it is written)

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from minivllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.llm import LLM
    from minivllm.hooks import EngineHooks
    from minivllm.outputs import CompletionOutput, RequestOutput
    from minivllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in MODULE_ATTRS:
        return getattr(import_module(MODULE_ATTRS[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *MODULE_ATTRS])
