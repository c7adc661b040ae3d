"""Platforms: each choice of implementation (attention, layer ops, matmuls, compile, graphs), once.

    interface.py       what a platform supplies (`Platform`) and its op table
    reference.py       plain torch everywhere: the code the chapters teach
    cpu.py             the C++ fast paths, which cpu_extension.py builds
    cpu_hardware.py    the CPU's facts: its default dtype, its threads and their placement
    cuda.py            Triton kernels and CUDA graphs

`choose_platform` picks one from the device, the dtype, `attention_backend` and MINIVLLM_PLATFORM;
the runner calls it once and builds the model from what it returns.
"""

from __future__ import annotations

import torch

from minivllm import envs
from minivllm.platforms.cpu import CpuPlatform
from minivllm.platforms.interface import Platform
from minivllm.platforms.reference import ReferencePlatform

__all__ = ["CpuPlatform", "Platform", "ReferencePlatform", "choose_platform", "platform_name"]

BACKENDS = ("auto", "torch", "triton")


def platform_name(device: str | torch.device, attention_backend: str = "auto") -> str:
    """Which platform runs: MINIVLLM_PLATFORM if set, else "cuda" on a GPU (or wherever Triton
    attention is asked for: on a CPU, under Triton's interpreter), "reference" for torch attention
    on a GPU, "cpu" on a CPU, "reference" elsewhere."""
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got "
                         f"{attention_backend!r}")
    device, name = torch.device(device), envs.MINIVLLM_PLATFORM
    if name == "auto":
        if attention_backend == "triton":
            return "cuda"
        if device.type == "cuda":
            return "reference" if attention_backend == "torch" else "cuda"
        return "cpu" if device.type == "cpu" else "reference"
    if (attention_backend == "triton") != (name == "cuda") and attention_backend != "auto":
        raise ValueError(f"attention_backend={attention_backend!r} contradicts "
                         f"MINIVLLM_PLATFORM={name!r}")
    return name


def choose_platform(device: str | torch.device, dtype: torch.dtype, attention_backend: str = "auto",
                    online_softmax_update=None) -> Platform:
    """The platform an engine runs on (see `platform_name`), built once. `online_softmax_update`: a
    learner's decode update (minivllm.hooks), which then attends decode steps on any platform."""
    name = platform_name(device, attention_backend)
    if name == "cuda":
        from minivllm.platforms.cuda import CudaPlatform as cls  # Triton: an optional dependency
    else:
        cls = CpuPlatform if name == "cpu" else ReferencePlatform
    return cls(device, dtype, online_softmax_update)
