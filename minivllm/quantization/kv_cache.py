"""The KV cache's element type: the model's ("auto"), or fp8 with a scale per tensor (vLLM's "fp8").

An fp8 cache holds twice the tokens of a 16-bit one. Each layer's K and V have a scale (1.0 unless
the checkpoint gives one): stored as fp8(x / scale), clamped, read back as float(fp8) * scale.
e4m3 ("fp8", "fp8_e4m3") has finer steps, range +-448; e5m2 ("fp8_e5m2") coarser, range +-57344.
This is the torch side; the Triton kernels encode the same bits themselves (kernels/fp8.py).
"""

from __future__ import annotations

import torch

# what `kv_cache_dtype=` accepts; "auto" is the model's own dtype
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
ACCEPTED_KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPES)


def check_kv_cache_dtype(name: object) -> None:
    """A ValueError listing the accepted names, for anything else (before any weight loads)."""
    if name not in ACCEPTED_KV_CACHE_DTYPES:
        accepted = ", ".join(map(repr, ACCEPTED_KV_CACHE_DTYPES))
        raise ValueError(f"kv_cache_dtype must be one of {accepted}, got {name!r}")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' element type: `model_dtype` for "auto", else the fp8 type named."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8, for ops torch lacks for fp8 on CPU (index_copy_)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: fp8(x / scale), clamped first (an fp8 cast of a value out of range
    is NaN or inf, not the largest value); unchanged when the cache is float."""
    if not is_fp8(dtype):
        return x
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements in the compute dtype: float(x) * scale (a float cache's as they are)."""
    if not is_fp8(x.dtype):
        return x
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale
