"""vLLM's import path `vllm.engine.arg_utils`: re-exports EngineArgs and AsyncEngineArgs (engine_args.py).

One of the thin modules that let vLLM code run with only `vllm` -> `minivllm` changed; the README's
"vLLM import paths" table lists them all.
"""

from minivllm.engine.engine_args import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
