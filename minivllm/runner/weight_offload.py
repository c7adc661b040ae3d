"""vLLM's `cpu_offload_gb`: a GPU too small for the weights keeps some of them in host memory.

The first decoder layers, up to `cpu_offload_gb` GiB of their weights, live in pinned host memory;
each one is copied onto the GPU just before its forward and dropped just after, so the GPU holds one
streamed layer at a time and the room saved goes to the KV cache. Every step then moves those bytes
over PCIe: a 16 GB/s link streams 1 GiB in about 65 ms a step, so this trades speed for fitting at
all (and decode steps run eagerly: a recorded CUDA graph would not run the copies). The model is
loaded onto the GPU first and offloaded after, so it must fit there while it loads. On a CPU the
weights are in host memory already: there it does nothing, and says so.
"""

from __future__ import annotations

import torch

from minivllm.logger import init_logger

logger = init_logger(__name__)


def offload_weights(model: torch.nn.Module, gib: float, device: torch.device) -> int:
    """Move the first decoder layers' tensors, up to `gib` GiB, to host memory and stream them in
    for each forward. Returns the bytes moved (0 off CUDA)."""
    if gib <= 0:
        return 0
    if device.type != "cuda":
        logger.warning("cpu_offload_gb=%s does nothing on %s: the weights are in host memory "
                       "already", gib, device.type)
        return 0
    budget, moved = int(gib * 2**30), 0
    for layer in model.model.layers:
        size = sum(t.numel() * t.element_size() for t in _tensors(layer))
        if moved + size > budget:
            break
        StreamedLayer(layer, device)
        moved += size
    logger.info("cpu_offload_gb: %.2f GiB of weights stream from host memory", moved / 2**30)
    return moved


def _tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [*layer.parameters(), *layer.buffers()]


class StreamedLayer:
    """One layer whose tensors live on the host: in before its forward, out after."""

    def __init__(self, layer: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.pairs = [(t, t.data.to("cpu").pin_memory() if pin else t.data.clone())
                      for t in _tensors(layer)]
        self.send_back(layer, (), None)
        layer.register_forward_pre_hook(self.bring_in)
        layer.register_forward_hook(self.send_back)

    def bring_in(self, layer: torch.nn.Module, args) -> None:
        for tensor, host in self.pairs:
            tensor.data = host.to(self.device, non_blocking=True, copy=True)

    def send_back(self, layer: torch.nn.Module, args, output) -> None:
        for tensor, host in self.pairs:
            tensor.data = host
