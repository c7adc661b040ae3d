"""Triton kernels for the paged KV cache: store new K/V, decode attention, prefill attention; and
three fused elementwise kernels the cuda platform (minivllm/platforms/cuda.py) also uses: RMSNorm
(with the residual add), rotary embedding and SwiGLU's silu(gate) * up.

Each module holds one kernel and its launcher, readable on its own; fp8.py holds the conversions
the three KV kernels share for an fp8 cache (kv_cache_dtype="fp8"); program_log.py runs one launch
in Triton's interpreter and logs what each program instance reads (chapter 08's kernel walk). On
CPU they run only through Triton's interpreter, chosen as kernels are defined: set
TRITON_INTERPRET=1 before importing triton.
"""

from minivllm.kernels.activation import silu_and_mul
from minivllm.kernels.norm import rms_norm
from minivllm.kernels.paged_decode import choose_num_splits, paged_decode_attention
from minivllm.kernels.paged_prefill import paged_prefill_attention
from minivllm.kernels.rotary import apply_rotary
from minivllm.kernels.store_kv import _store_kv_kernel, store_kv

__all__ = ["apply_rotary", "choose_num_splits", "interpreted", "paged_decode_attention",
           "paged_prefill_attention", "rms_norm", "silu_and_mul", "store_kv"]


def interpreted() -> bool:
    """True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_store_kv_kernel, InterpretedFunction)
