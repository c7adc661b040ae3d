"""The cuda platform: Triton kernels (attention, layer ops, quantized matmuls) and CUDA graphs.

Attention is attention/triton_backend.py; norm, rotary and SwiGLU are minivllm/kernels/ (norm.py,
rotary.py, activation.py); int8 and int4 weights go through kernels/int8_linear.py and
int4_linear.py, a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K layers through gguf_linear.py
as its blocks (kernels/quantized_linear.py); float weights stay with `F.linear` (cuBLAS). Decode
steps are recorded as CUDA graphs (runner/cuda_graphs.py) unless enforce_eager. On a CPU the Triton
kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): tests
run this platform that way, `attention_backend="triton"`, without graphs.
"""

from __future__ import annotations

from minivllm.attention.triton_backend import TritonAttentionBackend
from minivllm.kernels import apply_rotary, rms_norm, silu_and_mul
from minivllm.kernels.fused_moe import fused_moe_experts
from minivllm.kernels.quantized_linear import TRITON_GGUF, TRITON_INT4, TRITON_INT8
from minivllm.model.layer_ops import LayerOps
from minivllm.platforms.interface import Platform
from minivllm.quantization.base import LinearKernels
from minivllm.quantization.unquantized import FLOAT

TRITON_OPS = LayerOps(rms_norm=rms_norm, rotary=apply_rotary, silu_and_mul=silu_and_mul)


class CudaPlatform(Platform):
    name = "cuda"
    tested_by = {"attention": "tests/test_kernels.py", "rms_norm": "tests/test_kernels.py",
                 "rotary": "tests/test_kernels.py", "silu_and_mul": "tests/test_kernels.py",
                 "linear[int8]": "tests/test_quantization.py",
                 "linear[int4]": "tests/test_quantization.py",
                 "linear[gguf]": "tests/test_gguf_triton.py",
                 "moe_experts": "tests/test_fused_moe.py",
                 "cuda_graphs": "tests/test_cuda_graphs.py"}

    def __init__(self, device, dtype, online_softmax_update=None) -> None:
        super().__init__(device, dtype, online_softmax_update)
        # the backend checks the device now, not deep inside a kernel launch
        self.attention = self._hooked(TritonAttentionBackend(self.device))
        self.ops = TRITON_OPS
        self.linear = LinearKernels(float=FLOAT, int8=TRITON_INT8, int4=TRITON_INT4,
                                    gguf=TRITON_GGUF)
        self.moe_experts = fused_moe_experts

    def captures_graphs(self, enforce_eager: bool) -> bool:
        """Recorded decode steps need a real GPU (not the interpreter), and not enforce_eager."""
        return self.device.type == "cuda" and not enforce_eager
