"""Which linear layers of a GGUF model keep the file's blocks (quantization/gguf.py, issue 37).

A GGUF file gives each tensor its own type, and files users download mix them (Q4_K_M stores some
layers' attn_v and ffn_down as Q6_K, an embedding as Q8_0 or Q6_K). Where the platform multiplies
a type as stored (`LinearKernels.gguf`: the cpu and cuda platforms, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K and Q6_K; one process), a layer whose checkpoint tensors all have that type swaps its float
weight for `GgufLinearMethod`'s blocks, before any memory is allocated. A fused layer (q/k/v,
gate/up) whose shards differ in type holds each shard's blocks in its own type
(`GgufShardsLinearMethod`). A layer with a tensor of a type the kernel lacks is dequantized at load,
as is every layer under tensor parallelism or on another platform. A tied LM
head keeps the embedding's blocks (the embedding then looks its rows up there:
model/embedding.py), an untied one and the embedding table stay float.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model.linear import LinearBase
from minivllm.model.weights import LAYERS, PACKED
from minivllm.quantization.base import LinearKernel
from minivllm.quantization.gguf import GgufLinearMethod, GgufShardsLinearMethod

EMBEDDING = "model.embed_tokens.weight"


def checkpoint_names(layer_name: str) -> list[str]:
    """The checkpoint weights a layer of ours is loaded from, in shard order (a fused layer's
    parts: `...self_attn.qkv_proj` -> q_proj, k_proj, v_proj)."""
    prefix, _, ours = layer_name.rpartition(".")
    parts = sorted((shard, theirs) for theirs, (fused, shard) in PACKED.items() if fused == ours)
    return [f"{prefix}.{theirs}.weight" for _, theirs in parts] or [f"{layer_name}.weight"]


def keep_gguf_blocks(model: nn.Module, types: dict[str, int], kernel: LinearKernel,
                     dtype: torch.dtype, tie_word_embeddings: bool) -> frozenset[str]:
    """Give each decoder linear layer whose tensors have types `kernel` multiplies (and a tied
    head, the embedding's) a GgufLinearMethod (GgufShardsLinearMethod where a fused layer's shards
    differ); the checkpoint names to read as blocks."""
    kept: set[str] = set()
    layers = [(name, layer) for name, layer in model.named_modules()
              if isinstance(layer, LinearBase) and name.startswith(LAYERS)]
    if tie_word_embeddings:
        layers.append(("lm_head", model.lm_head))
    for name, layer in layers:
        parts = [EMBEDDING] if name == "lm_head" else checkpoint_names(name)
        kinds = {types.get(part) for part in parts}
        if not kinds <= set(kernel.types):
            continue
        del layer.weight, layer.layouts["weight"]
        if len(kinds) == 1:
            layer.quant_method = GgufLinearMethod(kernel, kinds.pop(), dtype)
        else:  # e.g. Q4_K q/k beside a Q6_K v: each shard in its own type
            layer.quant_method = GgufShardsLinearMethod(kernel, [types[p] for p in parts], dtype)
        layer.quant_method.create_weights(layer)
        kept.update(parts)
    return frozenset(kept)
