"""Checkpoint tensors into a model's parameters: the rules every loader shares (loader.py loads
them all at once, lazy_loading.py one decoder layer at a time)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minivllm.model.embedding import VocabParallelEmbedding
from minivllm.model.linear import LinearBase
from minivllm.model.moe_layer import EXPERT_PROJECTIONS, FusedExperts
from minivllm.model.registry import model_class

if TYPE_CHECKING:
    from minivllm.model.loader import ModelConfig

# checkpoint name -> (our fused parameter, which shard of it)
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

LAYERS = "model.layers."  # the decoder layers' tensors: model.layers.<i>.<...>
# one expert's projection (`...experts.<e>.<w1|gate_proj|...>.weight`), or all experts stacked
EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")
STACKED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


class CheckpointWeights:
    """Puts checkpoint tensors (Hugging Face names) into `module`'s parameters: fused q/k/v and
    gate/up shards, each linear layer's own format, this rank's vocabulary rows, fp8 KV scales.
    `prefix`: the module's name in the whole model; tensors named under `skip` are left out."""

    def __init__(self, module: torch.nn.Module, cfg: ModelConfig, prefix: str = "",
                 skip: str | None = None) -> None:
        self.module, self.cfg, self.prefix, self.skip = module, cfg, prefix, skip
        self.linears = {prefix + name: m for name, m in module.named_modules()
                        if isinstance(m, LinearBase)}
        self.experts = {prefix + name: m for name, m in module.named_modules()
                        if isinstance(m, FusedExperts) and not (skip and
                                                                (prefix + name).startswith(skip))}
        self.params = {prefix + name: p for name, p in module.named_parameters()
                       if (prefix + name).rpartition(".")[0] not in {**self.linears, **self.experts}
                       and not (skip and (prefix + name).startswith(skip))}
        # the family's names for parts of ours (Mixtral's block_sparse_moe is our mlp)
        self.renames = model_class(cfg.architecture).checkpoint_renames
        self.loaded: set[str] = set()

    def load(self, where: str | Path, name: str, tensor) -> None:
        """One checkpoint tensor; `tensor()` reads it (only if it is used)."""
        cfg = self.cfg
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        if ("rotary_emb" in name or (cfg.tie_word_embeddings and name == "lm_head.weight")
                or (self.skip and name.startswith(self.skip))
                or _load_kv_scale(self.module, self.prefix, name, tensor)):
            return
        if self._load_expert(where, name, tensor):
            return
        target, shard = name, None
        for ckpt_name, (fused, idx) in PACKED.items():
            if f".{ckpt_name}." in name:
                target, shard = name.replace(ckpt_name, fused), idx
        layer_name, _, param_name = target.rpartition(".")
        layer = self.linears.get(layer_name)
        if layer is not None and param_name in layer.layouts:
            layer.weight_loader(param_name, tensor(), shard, where=f"{where}: {name}")
            return
        if layer is not None and param_name == "bias" and not tensor().any():
            return  # some GPTQ exporters save all-zero biases for layers that have none
        if target not in self.params:
            hint = ("" if cfg.quantization else
                    " (a quantized checkpoint whose config.json lacks quantization_config?)")
            raise ValueError(f"{where}: unexpected tensor {name!r} for a {cfg.model_type} "
                             f"model{hint}")
        param, value = self.params[target], tensor()
        owner = self.module.get_submodule(target[len(self.prefix):].rpartition(".")[0])
        self.loaded.add(target)
        if isinstance(owner, VocabParallelEmbedding):  # this rank's vocab rows
            owner.weight_loader(value, where=f"{where}: {name}")
        elif param.shape != value.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected "
                             f"{tuple(param.shape)}")
        else:
            with torch.no_grad():
                param.copy_(value)

    def _load_expert(self, where: str | Path, name: str, tensor) -> bool:
        """An expert's weight, stacked into its layer's FusedExperts; True when `name` was one."""
        match = EXPERT.fullmatch(name)
        if match and match.group(1) in self.experts and match.group(3) in EXPERT_PROJECTIONS:
            self.experts[match.group(1)].load(int(match.group(2)), match.group(3), tensor,
                                              f"{where}: {name}")
            return True
        match = STACKED_EXPERTS.fullmatch(name)
        if match and match.group(1) in self.experts:
            self.experts[match.group(1)].load_fused(match.group(2), tensor(), f"{where}: {name}")
            return True
        return False

    def finish(self, path: Path) -> None:
        """Refuse a checkpoint that left a weight out; then let each linear layer prepare its
        tensors for its kernels."""
        linears = {name: layer for name, layer in self.linears.items()
                   if not (self.skip and name.startswith(self.skip))}
        missing = sorted([f"{n}#None" for n in self.params if n not in self.loaded]
                         + [f"{name}.{p}#{s}" for name, layer in linears.items()
                            for p, s in layer.expected() - layer.loaded]
                         + [f"{name}: {part}" for name, experts in self.experts.items()
                            for part in experts.missing()])
        if missing:
            raise ValueError(f"{path}: checkpoint is missing weights: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
        for layer in linears.values():
            layer.process_weights_after_loading()
        for experts in self.experts.values():
            experts.process_weights_after_loading()


def _load_kv_scale(module: torch.nn.Module, prefix: str, name: str, tensor) -> bool:
    """vLLM's names for fp8 KV scales: `model.layers.N.self_attn[.k_proj|.v_proj|.attn].k_scale`
    (or `.v_scale`; an older `.kv_scale` serves both). True when `name` was one, now on layer N."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?(k|v|kv)_scale",
                         name)
    if match is None:
        return False
    attn = module.get_submodule(f"model.layers.{match.group(1)}.self_attn"[len(prefix):])
    scale = float(tensor().float().reshape(-1)[0])  # per tensor: one value (or shape [1])
    if not scale > 0:
        raise ValueError(f"{name} must be a positive scale, got {scale}")
    for which in ("k", "v") if match.group(2) == "kv" else (match.group(2),):
        setattr(attn, f"{which}_scale", scale)
    return True
