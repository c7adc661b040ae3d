"""Quantized weights: one small module per format, each a config plus a linear method (see base.py).

    unquantized.py  float weights (through oneDNN and a small-batch kernel on CPUs)
    int8.py         weight-only int8, quantized at load from any float checkpoint (`quantization="int8"`)
    int4.py         what GPTQ and AWQ share: 4-bit groups, their CPU, Triton and torch matmuls
    gptq.py, awq.py the two published 4-bit checkpoint layouts, detected from config.json
    gguf.py         llama.cpp's GGUF files, read by path and dequantized at load
    packing.py      our own round-to-nearest quantizer writing GPTQ / AWQ checkpoints (tests, chapter 12)

Every refusal happens here, when the config is read: before any weight is.
"""

from __future__ import annotations

from minivllm.quantization.base import LinearMethod, QuantizationConfig

# what `quantization=` accepts; vLLM's names for its faster kernels on the same checkpoints mean the same here
ACCEPTED = {"int8": "int8", "gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
            "gguf": "gguf"}
CHECKPOINT_FORMATS = ("gptq", "awq")  # config.json quant_method values we load
SUPPORTED_TEXT = ("supported: quantization=None (the checkpoint as it is), 'int8' (weight-only, quantized at load "
                  "from any float checkpoint or GGUF file), 'gptq' or 'gptq_marlin' (4-bit GPTQ checkpoints), 'awq' "
                  "or 'awq_marlin' (4-bit AWQ checkpoints, GEMM layout), 'gguf' (a .gguf file of a Llama or Qwen "
                  "model, dequantized at load)")

__all__ = ["ACCEPTED", "LinearMethod", "QuantizationConfig", "checkpoint_quantization", "resolve_quantization",
           "layout_copy_bytes", "weight_bytes"]


def checkpoint_quantization(qc: dict | None, where: str) -> QuantizationConfig | None:
    """config.json's `quantization_config` -> our config, or a ValueError for a format we do not run."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        from minivllm.quantization.gptq import GPTQConfig

        return GPTQConfig.from_hf(qc, where)
    if method == "awq":
        from minivllm.quantization.awq import AWQConfig

        return AWQConfig.from_hf(qc, where)
    raise ValueError(f"{where}: the checkpoint is quantized with {method or 'an unnamed method'!r}, which "
                     f"minivllm does not run; {SUPPORTED_TEXT}")


def resolve_quantization(requested: str | None, checkpoint: QuantizationConfig | None, is_gguf: bool,
                         where: str) -> QuantizationConfig | None:
    """What the linear layers will hold, from `quantization=` and what the checkpoint is.

    None follows the checkpoint. A checkpoint format must match the checkpoint; "int8" needs float weights
    (a float checkpoint or a GGUF file, which is dequantized at load).
    """
    if requested is None or requested == "none":
        return checkpoint
    if not isinstance(requested, str) or requested.lower() not in ACCEPTED:
        raise ValueError(f"quantization={requested!r} is not supported by minivllm; {SUPPORTED_TEXT}")
    name = ACCEPTED[requested.lower()]
    have = "gguf" if is_gguf else checkpoint.name if checkpoint is not None else "float"
    if name == "int8":
        if checkpoint is not None:
            raise ValueError(f"quantization='int8' quantizes float weights, but {where} is already {have}: "
                             "leave quantization unset to run it as it is")
        from minivllm.quantization.int8 import Int8Config

        return Int8Config()
    if name != have:
        raise ValueError(f"quantization={requested!r}, but {where} is a {have} checkpoint "
                         f"(leave quantization unset to follow the checkpoint); {SUPPORTED_TEXT}")
    return checkpoint


def weight_bytes(model) -> int:
    """Bytes the model's weights take in their format, as loaded: every parameter and every buffer the linear
    layers keep (packed 4-bit words, scales), each tensor once; not the rotary tables, and not the copies a
    layer keeps in another layout for speed (`layout_copy_bytes`)."""
    from minivllm.model.linear import LinearBase

    tensors = {id(t): t for t in model.parameters()}
    for layer in model.modules():
        if isinstance(layer, LinearBase):
            copies = layer.quant_method.layout_copies
            tensors.update({id(t): t for name, t in layer.named_buffers(recurse=False)
                            if t is not None and name not in copies})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def layout_copy_bytes(model) -> int:
    """Bytes of the weights held a second time in another layout for speed: on a CPU, oneDNN's copy of a weight
    tied to the embedding and the small-batch kernel's copies (model/packed_linear.py, model/small_linear.py)."""
    from minivllm.model.linear import LinearBase

    return sum(t.numel() * t.element_size() for layer in model.modules() if isinstance(layer, LinearBase)
               for name, t in layer.named_buffers(recurse=False)
               if t is not None and name in layer.quant_method.layout_copies)
