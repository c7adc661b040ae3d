"""Every environment variable minivllm reads, in one table: name, type, default and what it does.

No other module reads `os.environ`. A value is read when asked for, not at import (as vLLM's envs):
a notebook cell that sets a variable after `import minivllm` counts, as does a monkeypatch."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    parse: Callable[[str], Any]  # the text as set -> its typed value, or a ValueError
    default: Any  # when unset (or set to the empty string)
    doc: str


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(repr(a) for a in allowed)}")
        return text

    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return text == "1"


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def _hub_flag(text: str) -> bool:
    """As huggingface_hub reads its own flags: these spellings are true, anything else false."""
    return text.strip().lower() in ("1", "true", "yes", "on")


VARIABLES: dict[str, EnvVar] = {
    # --- which implementation runs (minivllm/platforms/) ---
    "MINIVLLM_PLATFORM": EnvVar(_choice("auto", "reference", "cpu", "cuda"), "auto",
        "the platform the engine runs on: 'auto' (cuda on a GPU, cpu elsewhere), or 'reference' "
        "for the readable torch code the chapters print, everywhere"),
    "MINIVLLM_CPU_ATTENTION": EnvVar(_choice("kernel", "reference"), "kernel",
        "cpu platform: 'reference' attends with the torch reference instead of the C++ kernel"),
    "MINIVLLM_CPU_LAYER_OPS": EnvVar(_flag, True,
        "cpu platform: 0 keeps the readable norm, rotary and SwiGLU instead of the C++ ops"),
    "MINIVLLM_CPU_SMALL_LINEAR": EnvVar(_flag, True,
        "cpu platform: 0 serves every linear call with oneDNN, none with the small-batch kernel"),
    "MINIVLLM_CPU_BOUND_LAYERS": EnvVar(_flag, True,
        "cpu platform: 0 runs decode steps through the decoder layers' modules instead of each "
        "layer's ops bound into one function (model/cpu_bound_layer.py), or one C++ op where "
        "its matmuls are the tiled or GGUF kernels (model/cpu_decoder_layer.cpp)"),
    "MINIVLLM_CPU_GGUF_ACTIVATIONS": EnvVar(_choice("auto", "float", "int8"), "auto",
        "cpu platform, a GGUF file's block layers: 'int8' quantizes x per 32 values and "
        "multiplies in integers (llama.cpp's arithmetic; needs AVX2 or "
        "AVX512-VNNI), 'float' multiplies the exact weights by float x; 'auto': int8 when "
        "the model computes in bf16 or fp16"),
    "MINIVLLM_CPU_COMPILE": EnvVar(_flag, False,
        "cpu platform: 1 compiles the layers around attention with torch.compile (opt-in)"),
    # --- dtypes and threads ---
    "MINIVLLM_CPU_DTYPE": EnvVar(_choice("float32", "bfloat16", "float16"), None,
        "dtype='auto' on CPU for a whole run (the test suite pins float32); unset: bf16 where "
        "native"),
    "MINIVLLM_CUDA_DTYPE": EnvVar(_choice("float32", "bfloat16", "float16"), None,
        "dtype='auto' on a GPU for a whole run (bench/gpu_check.sh: float16, as on a T4)"),
    "MINIVLLM_CPU_OMP_THREADS_BIND": EnvVar(str.strip, "off",
        "pin torch's threads: 'off', 'auto' (the free cores, when idle) or a list like 0-7"),
    "MINIVLLM_CACHE_DIR": EnvVar(str, "~/.cache/minivllm",
        "where the C++ CPU kernels are built and kept (platforms/cpu_extension.py), one folder "
        "per sources, CPU and torch; ~ is expanded"),
    # --- data parallelism (minivllm/model/weight_cache.py) ---
    "MINIVLLM_WEIGHT_CACHE_DIR": EnvVar(str, "~/.cache/minivllm/weights",
        "data_parallel_size > 1: where the loaded weights are written once (a file per "
        "checkpoint, dtype and platform) for every engine to map; ~ is expanded"),
    # --- profiling and serving (vLLM's names are read too) ---
    "MINIVLLM_TORCH_PROFILER_DIR": EnvVar(os.path.expanduser, None,
                                          "LLM.start_profile() writes its trace here"),
    "VLLM_TORCH_PROFILER_DIR": EnvVar(os.path.expanduser, None,
                                      "vLLM's name for MINIVLLM_TORCH_PROFILER_DIR (ours wins)"),
    "VLLM_API_KEY": EnvVar(str, None, "the server's API key when --api-key is not given"),
    "VLLM_CPU_KVCACHE_SPACE": EnvVar(_non_negative, None,
        "GiB of KV cache on CPU when kv_cache_memory_bytes is not given (vLLM's CPU knob); "
        "unset or 0: 512 MiB (core/kv_sizing.py)"),
    # --- the Hugging Face Hub (read now, where huggingface_hub read them at its import) ---
    "HF_HUB_OFFLINE": EnvVar(_hub_flag, False,
                             "never download: only local directories and the cache"),
    "HF_HUB_CACHE": EnvVar(os.path.expandvars, None, "where Hub downloads go"),
    "HF_HOME": EnvVar(os.path.expandvars, None, "HF_HUB_CACHE defaults to $HF_HOME/hub"),
    # --- torchrun's rendezvous (tensor parallelism across processes it started) ---
    "RANK": EnvVar(int, None, "this process's rank"),
    "WORLD_SIZE": EnvVar(int, None, "how many ranks torchrun started"),
    "LOCAL_RANK": EnvVar(int, None, "this process's rank on its machine (its GPU index)"),
    "MASTER_ADDR": EnvVar(str, None, "the rendezvous host"),
    "MASTER_PORT": EnvVar(int, None, "the rendezvous port"),
    "TORCHELASTIC_USE_AGENT_STORE": EnvVar(lambda text: text == "True", False,
                                           "torchrun's agent hosts the store (not rank 0)"),
}


def read(name: str) -> Any:
    """The typed value of one variable of the table, now; a bad value is a ValueError naming it."""
    var = VARIABLES[name]
    text = os.environ.get(name, "")
    if text == "":
        return var.default
    try:
        return var.parse(text)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={text!r}: {err}") from None


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides` set, for a child process: the one place that
    copies it (kernels/program_log.py starts a Python with TRITON_INTERPRET=1 this way)."""
    return {**os.environ, **overrides}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *VARIABLES]
