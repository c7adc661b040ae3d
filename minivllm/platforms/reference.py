"""The reference platform: plain torch everywhere, on any device.

The code the chapters print and the oracle every fast path is tested against: the torch attention
backend (attention/torch_backend.py), the readable norm, rotary and SwiGLU (model/layer_ops.py),
`F.linear` for float weights and dequantize-then-multiply for int8 and int4 (quantization/). No C++,
no Triton, no compile, no CUDA graphs: the `Platform` defaults as they are.
MINIVLLM_PLATFORM=reference picks it; `attention_backend="torch"` on a GPU too.
"""

from __future__ import annotations

from minivllm.platforms.interface import Platform


class ReferencePlatform(Platform):
    name = "reference"
