"""The cpu platform: the C++ fast paths, each registered here and nowhere else.

What it replaces, and the switch (read here, once per platform) that keeps the readable code:

* attention: attention/cpu_attention.py (the cache read in place);
  MINIVLLM_CPU_ATTENTION=reference keeps the torch reference, and with it the readable layer ops;
* norm, rotary, SwiGLU: model/cpu_layer_ops.py (one fused op per chain); MINIVLLM_CPU_LAYER_OPS=0;
* float matmuls: quantization/cpu_unquantized.py, each weight held once: tiled where the CPU has
  AVX-512 or AVX2 (MINIVLLM_CPU_SMALL_LINEAR=0 rules that out), else oneDNN's layout where fast,
  else plain;
* int8 and int4 matmuls: torch's packed-weight kernels (quantization/cpu_quantized.py);
* GGUF files: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K layers kept as the file's blocks, multiplied
  as stored (quantization/cpu_gguf.py; one process; without the C++ build: dequantized at load);
* a decode step's decoder layers: their ops bound into one function each (model/cpu_bound_layer.py),
  where the fused ops and the C++ attention serve them; one C++ op each where their matmuls are the
  tiled or GGUF kernels (model/cpu_decoder_layer.cpp); MINIVLLM_CPU_BOUND_LAYERS=0;
* torch.compile of the layers around attention (model/compiled.py): opt-in, MINIVLLM_CPU_COMPILE=1
  (it takes the place of the bound layers).

The C++ sources are built once per process (platforms/cpu_extension.py); without a compiler every
C++ path falls back to the readable one after one warning.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from minivllm import envs
from minivllm.attention import cpu_attention
from minivllm.logger import init_logger
from minivllm.model import cpu_layer_ops
from minivllm.model.compiled import CompiledLayers, compile_decoder_layers
from minivllm.model.cpu_bound_layer import BoundLayer, bind_decoder_layers
from minivllm.platforms import cpu_extension
from minivllm.platforms.cpu_hardware import cpu_flags, cpu_has_native_bf16
from minivllm.platforms.cpu_moe import chosen_experts
from minivllm.platforms.interface import Platform, qualified_name
from minivllm.quantization import cpu_gguf, cpu_unquantized
from minivllm.quantization.base import LinearKernels
from minivllm.quantization.cpu_quantized import CPU_INT4, CPU_INT8
from minivllm.quantization.unquantized import FLOAT, FloatKernel

logger = init_logger(__name__)


@functools.cache  # one build (or one failure, one warning) per process
def extension_built() -> bool:
    """Build the C++ ops, register their shapes for torch.compile; False (warned once) if not."""
    reason = cpu_extension.build_failure()
    if reason is not None:  # no compiler, no headers, a failed build: the readable code still works
        logger.warning("CPU C++ fast paths unavailable, using the readable torch code: %s", reason)
        return False
    cpu_attention.register_fake()
    cpu_layer_ops.register_fakes()
    cpu_unquantized.register_fake()
    cpu_gguf.register_fake()
    return True


def tiled_applies(dtype: torch.dtype) -> bool:
    """The tiled kernel needs AVX-512, or AVX2 with FMA (bf16 uses AVX512-BF16 where the CPU has
    it, two fused multiply-adds per pair where it does not: either way half of fp32's bytes are
    read)."""
    flags = cpu_flags()
    vector = "avx512f" in flags or {"avx2", "fma"} <= flags
    return vector and dtype in (torch.float32, torch.bfloat16)


def onednn_applies(dtype: torch.dtype) -> bool:
    """fp32, or bf16 on a CPU with native bf16, through a torch built with oneDNN's linear."""
    fast_dtype = dtype == torch.float32 or dtype == torch.bfloat16 and cpu_has_native_bf16()
    return (fast_dtype and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def float_kernel(dtype: torch.dtype, tiled_wanted: bool = True) -> FloatKernel:
    """The one layout float weights are held in for `dtype`: tiled, oneDNN's, or plain."""
    if tiled_wanted and tiled_applies(dtype) and extension_built():
        return cpu_unquantized.TILED
    return cpu_unquantized.ONEDNN if onednn_applies(dtype) else FLOAT


class CpuPlatform(Platform):
    name = "cpu"
    tested_by = {"attention": "tests/test_cpu_attention.py",
                 "rms_norm": "tests/test_cpu_layer_ops.py", "rotary": "tests/test_cpu_layer_ops.py",
                 "silu_and_mul": "tests/test_cpu_layer_ops.py",
                 "linear[float]": "tests/test_small_linear.py",
                 "linear[int8]": "tests/test_quantization.py",
                 "linear[int4]": "tests/test_quantization.py",
                 "linear[gguf]": "tests/test_cpu_gguf.py", "compile": "tests/test_compiled.py",
                 "decoder_layer": "tests/test_cpu_bound_layer.py",
                 "moe_experts": "tests/test_moe.py"}

    def __init__(self, device, dtype, online_softmax_update=None) -> None:
        super().__init__(device, dtype, online_softmax_update)
        if self.device.type != "cpu":
            raise ValueError(f"the cpu platform runs on the CPU, not {self.device}")
        # every switch read here, once (a bad value fails now, whichever paths it would touch)
        kernel_attention = envs.MINIVLLM_CPU_ATTENTION == "kernel"
        fused_ops, tiled = envs.MINIVLLM_CPU_LAYER_OPS, envs.MINIVLLM_CPU_SMALL_LINEAR
        self.compile_layers = envs.MINIVLLM_CPU_COMPILE
        self.bound_layers = envs.MINIVLLM_CPU_BOUND_LAYERS
        if kernel_attention and extension_built():
            self.attention = self._hooked(cpu_attention.CpuAttentionBackend())
            if fused_ops:
                self.ops = cpu_layer_ops.OPS
        gguf = cpu_gguf.CPU_GGUF if extension_built() else None  # None: dequantized at load
        self.linear = LinearKernels(float=float_kernel(dtype, tiled), int8=CPU_INT8, int4=CPU_INT4,
                                    gguf=gguf)
        self.moe_experts = chosen_experts

    def compile(self, model: nn.Module,
                enforce_eager: bool) -> CompiledLayers | list[BoundLayer] | None:
        """torch.compile where opted in (MINIVLLM_CPU_COMPILE=1, not enforce_eager: so far it cost
        more than it saved); else the bound layers, unless MINIVLLM_CPU_BOUND_LAYERS=0."""
        if self.compile_layers and not enforce_eager:
            return compile_decoder_layers(model)
        return bind_decoder_layers(model) if self.bound_layers else None

    def decoder_layer_name(self) -> str:
        if self.bound_layers and not self.compile_layers and self.ops is cpu_layer_ops.OPS:
            return qualified_name(bind_decoder_layers)
        return super().decoder_layer_name()

    def compiler_name(self) -> str:
        return qualified_name(compile_decoder_layers) if self.compile_layers else "none"
