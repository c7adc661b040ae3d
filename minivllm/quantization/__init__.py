"""Quantized weights: one small module per format, each a config plus a linear method (base.py).

int8.py quantizes any float checkpoint at load; gptq.py and awq.py read the two published 4-bit
layouts, which share int4.py; gguf.py reads llama.cpp's files; packing.py writes GPTQ / AWQ
checkpoints with our own quantizer (tests, ch. 12). Every refusal happens here, when the config is
read: before any weight is.
"""

from __future__ import annotations

from minivllm.quantization.awq import AWQConfig
from minivllm.quantization.base import LinearKernels, LinearMethod, QuantizationConfig
from minivllm.quantization.gptq import GPTQConfig
from minivllm.quantization.int4 import INT4
from minivllm.quantization.int8 import INT8, Int8Config
from minivllm.quantization.unquantized import FLOAT

# the readable kernel of each family: what a layer gets unless a platform hands it others
REFERENCE_KERNELS = LinearKernels(float=FLOAT, int8=INT8, int4=INT4)

# what `quantization=` accepts; vLLM's names for its faster kernels on the same checkpoints mean the
# same here
ACCEPTED = {"int8": "int8", "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq",
            "awq_marlin": "awq", "gguf": "gguf"}
SUPPORTED_TEXT = ("supported: quantization=None (the checkpoint as it is), 'int8' (weight-only, "
                  "quantized at load from any float checkpoint or GGUF file), 'gptq' or "
                  "'gptq_marlin' (4-bit GPTQ checkpoints), 'awq' or 'awq_marlin' (4-bit AWQ "
                  "checkpoints, GEMM layout), 'gguf' (a .gguf file of a Llama or Qwen model: "
                  "its Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K blocks kept on the cpu and cuda "
                  "platforms, the rest dequantized at load)")

__all__ = ["ACCEPTED", "REFERENCE_KERNELS", "LinearKernels", "LinearMethod", "QuantizationConfig",
           "checkpoint_quantization", "held_bytes", "resolve_quantization", "weight_bytes"]


def checkpoint_quantization(qc: dict | None, where: str) -> QuantizationConfig | None:
    """config.json's `quantization_config` -> our config, or a ValueError for a format we lack."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return {"gptq": GPTQConfig, "awq": AWQConfig}[method].from_hf(qc, where)
    named = method or "an unnamed method"
    raise ValueError(f"{where}: the checkpoint is quantized with {named!r}, which minivllm does "
                     f"not run; {SUPPORTED_TEXT}")


def resolve_quantization(requested: str | None, checkpoint: QuantizationConfig | None,
                         is_gguf: bool, where: str) -> QuantizationConfig | None:
    """What the linear layers will hold, from `quantization=` and the checkpoint. None follows the
    checkpoint; a checkpoint format must match it; "int8" needs float weights (a float checkpoint,
    or a GGUF file, which "int8" has dequantized at load)."""
    if requested is None or requested == "none":
        return checkpoint
    if not isinstance(requested, str) or requested.lower() not in ACCEPTED:
        raise ValueError(f"quantization={requested!r} is not supported by minivllm; "
                         f"{SUPPORTED_TEXT}")
    name = ACCEPTED[requested.lower()]
    have = "gguf" if is_gguf else checkpoint.name if checkpoint is not None else "float"
    if name == "int8":
        if checkpoint is not None:
            raise ValueError(f"quantization='int8' quantizes float weights, but {where} is already "
                             f"{have}: leave quantization unset to run it as it is")
        return Int8Config()
    if name != have:
        raise ValueError(f"quantization={requested!r}, but {where} is a {have} checkpoint "
                         f"(leave quantization unset to follow the checkpoint); {SUPPORTED_TEXT}")
    return checkpoint


def weight_bytes(model) -> int:
    """Bytes the model's weights take in their format, as loaded: every parameter and every buffer
    the linear layers keep (packed 4-bit words, scales), each tensor once; not the rotary tables."""
    linear_buffers = [t for layer in model.modules() if hasattr(layer, "quant_method")
                      for t in layer.buffers(recurse=False)]  # a linear layer (model/linear.py)
    return _bytes([*model.parameters(), *linear_buffers])


def held_bytes(model) -> int:
    """Bytes the model holds: every parameter and buffer, each tensor once (a tied weight too). A
    platform's fast layouts replace the checkpoint's, so this stays close to `weight_bytes`."""
    return _bytes([*model.parameters(), *model.buffers()])


def _bytes(tensors: list) -> int:
    """Bytes of `tensors`, each counted once however often it is listed."""
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())
