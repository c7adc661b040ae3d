"""Our own 4-bit quantizer: round-to-nearest per group, written in GPTQ's or AWQ's published layout.

Not GPTQ's or AWQ's algorithm (those choose q to minimise the layer's output error on calibration
data, or rescale salient channels first): plain rounding, enough to produce checkpoints that load
exactly like the ones on the Hub (tests/test_quantization.py, chapter 12).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from minivllm.quantization.awq import ORDER
from minivllm.quantization.int4 import pack_cols, pack_rows

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [K, N] int32, z [K/G, N] int32, s [K/G, N] fp16): W[n, k] ~ (q - z) * s.

    Each group's range [min(w, 0), max(w, 0)] is cut into 15 steps (the scale, rounded to fp16
    first, as stored); z is where 0 falls. g_idx [K] assigns inputs to groups (default k // G).
    min_zero=1 keeps z representable in GPTQ v1 checkpoints, which store z - 1 in four bits.
    """
    n, k = weight.shape
    g_idx = torch.arange(k) // group_size if g_idx is None else g_idx.long()
    w = weight.float().T  # [K, N]
    rows = g_idx[:, None].expand(k, n)
    lo = torch.zeros(k // group_size, n).scatter_reduce_(0, rows, w, "amin")  # zeros: min(w, 0)
    hi = torch.zeros(k // group_size, n).scatter_reduce_(0, rows, w, "amax")
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(min_zero, 15)
    q = torch.round(w / scale.float()[g_idx]) + zero[g_idx]
    return q.clamp(0, 15).to(torch.int32), zero.to(torch.int32), scale


def gptq_tensors(q, zeros, scales, g_idx: torch.Tensor | None = None,
                 v1: bool = True) -> dict[str, torch.Tensor]:
    """qweight [K/8, N] (down the inputs), qzeros [K/G, N/8] (across; v1: z - 1), scales, g_idx."""
    k = q.shape[0]
    g_idx = torch.arange(k) // (k // scales.shape[0]) if g_idx is None else g_idx
    return {"qweight": pack_rows(q), "qzeros": pack_cols((zeros - 1) & 0xF if v1 else zeros),
            "scales": scales.to(torch.float16), "g_idx": g_idx.to(torch.int32)}


def awq_tensors(q, zeros, scales) -> dict[str, torch.Tensor]:
    """qweight [K, N/8] and qzeros [K/G, N/8], eight outputs per word in AWQ's ORDER, and scales."""
    interleave = lambda t: t.reshape(t.shape[0], -1, 8)[:, :, list(ORDER)].reshape(t.shape)  # noqa: E731
    return {"qweight": pack_cols(interleave(q)), "qzeros": pack_cols(interleave(zeros)),
            "scales": scales.to(torch.float16)}


def dequantized_weight(q, zeros, scales, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] fp32 exactly as the loaders compute it: (q - z[g]) * s[g]."""
    k = q.shape[0]
    g = torch.arange(k) // (k // scales.shape[0]) if g_idx is None else g_idx.long()
    return ((q.float() - zeros[g].float()) * scales[g].float()).T


def _act_order_groups(layer: str, k: int, group_size: int, orders: dict[str, torch.Tensor],
                      gen: torch.Generator) -> torch.Tensor:
    """A random input -> group map (act-order), shared by the layers that read the same input."""
    module, _, proj = layer.rpartition(".")
    key = module + {"q_proj": ".qkv", "k_proj": ".qkv", "v_proj": ".qkv",
                    "gate_proj": ".gate_up", "up_proj": ".gate_up"}.get(proj, "." + proj)
    if key not in orders:
        orders[key] = torch.empty(k, dtype=torch.long)
        orders[key][torch.randperm(k, generator=gen)] = torch.arange(k) // group_size
    return orders[key]


def _save_checkpoint(dst: Path, tensors: dict[str, torch.Tensor], config: dict,
                     extras: list[Path]) -> None:
    """One checkpoint directory: tensors, config.json and the source's other (tokenizer) files."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in extras:
        shutil.copy(f, dst / f.name)


def write_quantized_checkpoint(src: str | Path, dst: str | Path, fmt: str = "gptq",
                               group_size: int = 128, act_order_seed: int | None = None,
                               float_twin: str | Path | None = None) -> dict:
    """Quantize every decoder linear of the float checkpoint `src` into `dst`, as "gptq" or "awq".

    act_order_seed (GPTQ only): assign inputs to groups by a random permutation, as act-order
    checkpoints do. float_twin: also write a float checkpoint of exactly the dequantized weights
    (for transformers, which then computes what a correct loader must). Returns {"quantized": bytes,
    "float": bytes}.
    """
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    out, twin, sizes = {}, {}, {"quantized": 0, "float": 0}
    gen = torch.Generator().manual_seed(act_order_seed or 0)
    # layers that read the same input share one order (as in GPTQ)
    orders: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        layer, _, kind = name.rpartition(".")
        if kind != "weight" or layer.rpartition(".")[2] not in QUANTIZED:
            out[name] = twin[name] = t
            sizes["quantized"] += t.numel() * t.element_size()
            continue
        g_idx = (None if act_order_seed is None
                 else _act_order_groups(layer, t.shape[1], group_size, orders, gen))
        q, z, s = quantize_groups(t, group_size, g_idx, min_zero=1 if fmt == "gptq" else 0)
        parts = gptq_tensors(q, z, s, g_idx) if fmt == "gptq" else awq_tensors(q, z, s)
        for part, value in parts.items():
            out[f"{layer}.{part}"] = value.contiguous()
            sizes["quantized"] += value.numel() * value.element_size()
        twin[name] = dequantized_weight(q, z, s, g_idx).contiguous()
        sizes["float"] += t.numel() * 4
    config = json.loads((src / "config.json").read_text())
    # quantization_config as GPTQ's or AWQ's tools write it
    qc = {"quant_method": fmt, "bits": 4, "group_size": group_size}
    qc.update({"desc_act": act_order_seed is not None, "sym": False, "checkpoint_format": "gptq"}
              if fmt == "gptq" else {"zero_point": True, "version": "gemm"})
    config["quantization_config"] = qc
    extras = [f for f in src.iterdir() if f.is_file() and f.suffix != ".safetensors"
              and f.name != "config.json"]
    _save_checkpoint(dst, out, config, extras)
    if float_twin is not None:
        config.pop("quantization_config")
        config["dtype"] = "float32"
        _save_checkpoint(Path(float_twin), {k: v.float().contiguous() for k, v in twin.items()},
                         config, extras)
    return sizes
