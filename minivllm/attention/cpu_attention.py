"""The CPU's attention: cpu_paged_attention.cpp, beside the torch reference (torch_backend.py).

Why C++: the reference copies each request's K/V blocks out of the cache into a padded tensor and
masks the padding; on CPU that copy and the masked SDPA were over a quarter of a decode step. The
kernel reads the blocks in place, and stores the step's new keys and values first (one op per layer
instead of store_kv's handful); platforms/cpu_extension.py builds it. The cpu platform
(platforms/cpu.py) chooses this backend, unless MINIVLLM_CPU_ATTENTION=reference or the build
fails; what the kernel does not handle (an fp8 cache, padded rows) goes to the reference.
"""

from __future__ import annotations

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the query dtypes the kernel reads


def register_fake() -> None:
    """The op's output shape, for torch.compile (it can then trace a model through the op without a
    graph break; the schema marks the caches as written). Called once the extension is built."""
    torch.library.register_fake("minivllm_cpu::paged_attention")(lambda q, *_: q.new_empty(q.shape))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Given k and v (this step's keys and values), store them at meta.slot_mapping as store_kv
    does, then attend every query over its request's context (with a `sliding_window` w: its w
    latest keys): [T, heads, dim]."""
    slots = meta.slot_mapping
    if k is None:  # attend only: nothing new to store
        k = v = k_cache.new_empty(0, *k_cache.shape[2:])
        slots = slots[:0]
    return torch.ops.minivllm_cpu.paged_attention.default(q, k, v, k_cache, v_cache, slots,
                                                          meta.block_tables, meta.seq_lens,
                                                          meta.query_start_loc, scale,
                                                          -1 if sliding_window is None
                                                          else sliding_window)


def fits(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
         k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> bool:
    """What the kernel handles: CPU tensors, a cache in the query's dtype (an fp8 cache takes the
    reference), and no padded rows; new keys and values (if given) in the cache's dtype, their last
    dim contiguous."""
    # plain comparisons, no generator: this runs once per layer and step (30 times a decode step)
    new_kv_fit = k is None or (k.dtype == v.dtype == k_cache.dtype and k.stride(-1) == 1
                               and v.stride(-1) == 1)
    return (q.device.type == "cpu" and k_cache.dtype == q.dtype and q.dtype in FLOAT_DTYPES
            and q.stride(-1) == 1 and new_kv_fit and k_cache.is_contiguous()
            and sum(meta.query_lens_cpu) == q.shape[0])


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend's contract, through the C++ kernel wherever it `fits`."""

    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, sliding_window: int | None = None) -> torch.Tensor:
        if fits(q, k_cache, meta, k, v):
            return paged_attention(q, k_cache, v_cache, meta, scale, k, v, sliding_window)
        return super().forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale,
                               sliding_window)
