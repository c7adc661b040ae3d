"""Lazy loading: a decoder layer's weights are read the first time a forward pass reaches it.

`LLM(..., lazy_loading=True)` builds the model with its decoder layers unallocated (on torch's
"meta" device: shapes, no memory). Each layer carries a forward pre-hook; the first step that runs
the layer allocates it, reads its tensors from the checkpoint (memory-mapped safetensors: only
this layer's bytes are touched), lets each linear layer prepare its kernels' layout, and removes
the hook. So the engine is ready as soon as the config, the tokenizer, the embeddings and the KV
cache are, and the first request pays for the weights instead. Every later step runs exactly the
eager model. (On a GPU the memory profiling run and the CUDA graph capture already run every
layer while the engine starts, so there the weights are all loaded before the first request.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from minivllm.model.weights import LAYERS, CheckpointWeights

if TYPE_CHECKING:
    from minivllm.model.loader import ModelConfig


def load_layers_on_first_use(model: torch.nn.Module, path: Path, cfg: ModelConfig, device: str,
                             dtype: torch.dtype) -> None:
    """Give every (unallocated) decoder layer a hook that loads it when it first runs."""
    files: dict[int, dict[str, Path]] = {}  # layer -> {tensor name: its safetensors file}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt", device="cpu") as f:  # reads the header only
            for name in f.keys():
                if name.startswith(LAYERS):
                    files.setdefault(int(name[len(LAYERS):].split(".")[0]), {})[name] = file
    for i, layer in enumerate(model.model.layers):
        LoadOnFirstUse(layer, f"{LAYERS}{i}.", files.get(i, {}), path, cfg, device, dtype)


class LoadOnFirstUse:
    """The forward pre-hook of one decoder layer: allocate it, read its tensors, then step aside."""

    def __init__(self, layer: torch.nn.Module, prefix: str, files: dict[str, Path], path: Path,
                 cfg: ModelConfig, device: str, dtype: torch.dtype) -> None:
        self.prefix, self.files, self.path, self.cfg = prefix, files, path, cfg
        self.device, self.dtype = device, dtype
        self.handle = layer.register_forward_pre_hook(self)

    def __call__(self, layer: torch.nn.Module, args) -> None:
        layer.to_empty(device=self.device).to(self.dtype)
        weights = CheckpointWeights(layer, self.cfg, self.prefix)
        for file in sorted(set(self.files.values())):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in (n for n, where in self.files.items() if where == file):
                    weights.load(file, name, lambda f=f, name=name: f.get_tensor(name))
        weights.finish(self.path)
        self.handle.remove()
