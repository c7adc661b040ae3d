"""minivllm: a compact vLLM-style inference engine, written to be read."""

from minivllm.config import EngineConfig
from minivllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minivllm.engine.engine_args import AsyncEngineArgs, EngineArgs
from minivllm.engine.llm import LLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.hooks import EngineHooks
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "AsyncEngineArgs",
           "EngineConfig", "EngineHooks", "SamplingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
