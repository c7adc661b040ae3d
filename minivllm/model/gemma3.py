"""Gemma 3 (text): Llama's attention and MLP, dressed differently.

What differs from llama.py, and why each is here rather than there:
- the embedding is scaled by sqrt(hidden), rounded to the model's dtype first (as transformers);
- RMSNorm multiplies by (1 + weight) in fp32 before rounding (the checkpoint stores weight - 1);
- four norms a layer: before and after attention, before and after the MLP, and q/k norms;
- the MLP's activation is GELU (tanh approximation), not SiLU: GeGLU;
- local (sliding) layers rotate with their own base (`rope_local_base_freq`), global layers with
  the global one and its scaling, if any;
- the attention scale is `query_pre_attn_scalar`**-0.5, not head_dim**-0.5;
- the final logits may be soft-capped: cap * tanh(logits / cap).

The (1 + weight) norm and GeGLU always run the readable torch code below: a platform's fused
RMSNorm and SiLU ops have another contract (llama's weight * norm, SiLU), so Gemma falls back to
the reference for these two ops on every platform; rotary and attention are the platform's own.

Refused, with a message: attention-score soft-capping (Gemma 2 sets it; Gemma 3 checkpoints set
None; our attention kernels do not cap scores), bidirectional attention, and float16 (Gemma's
activations outgrow fp16's range: transformers itself recommends bfloat16 or float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel import SINGLE, TensorParallel
from minivllm.model.embedding import VocabParallelEmbedding
from minivllm.model.linear import ColumnLinear
from minivllm.model.llama import (
    MLP,
    READABLE,
    Attention,
    Implementations,
    LlamaForCausalLM,
    layer_window,
)
from minivllm.model.rotary import RotaryEmbedding
from minivllm.quantization.unquantized import UnquantizedLinearMethod


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """norm(x) * (1 + weight), in fp32, rounded to x's dtype only at the end (as transformers)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> gelu_tanh(gate) * up [T, I]: GeGLU's activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gemma_options(hf) -> dict:
    """The local/global pattern from the config; what we cannot run is refused here."""
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma: attn_logit_softcapping is not supported (the attention kernels do "
                         "not cap scores); Gemma 3 checkpoints leave it None")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("Gemma: use_bidirectional_attention is not supported (decoding is causal)")
    sliding = local_layers(hf)
    window = getattr(hf, "sliding_window", None)
    # every layer local: None says "all slide", so blocks leave with the window as for Mistral v0.1
    return {"sliding_window": window if any(sliding) else None,
            "sliding_layers": sliding if window is not None and not all(sliding) else None}


def local_layers(hf) -> tuple[bool, ...]:
    """Which layers are local (sliding): `layer_types`, or 4.x's `sliding_window_pattern` (every
    pattern-th layer global)."""
    pattern = getattr(hf, "sliding_window_pattern", None) or 6
    types = getattr(hf, "layer_types", None) or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(hf.num_hidden_layers)]
    return tuple(kind == "sliding_attention" for kind in types)


def rope_of(hf, kind: str) -> tuple[float, dict | None]:
    """(theta, scaling) of `kind` ('sliding_attention' or 'full_attention') layers, from
    transformers 5's per-kind `rope_parameters` or 4.x's rope_theta / rope_local_base_freq."""
    params = getattr(hf, "rope_parameters", None) or {}
    if kind in params:
        rope = dict(params[kind])
    elif kind == "sliding_attention":
        rope = {"rope_theta": getattr(hf, "rope_local_base_freq", 10_000.0)}
    else:
        rope = {"rope_theta": getattr(hf, "rope_theta", 1_000_000.0),
                **(getattr(hf, "rope_scaling", None) or {})}
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    return float(rope["rope_theta"]), rope if scaled else None


class GemmaRotary(nn.Module):
    """The two rotary tables, local and global; loader.py calls build() as for one."""

    def __init__(self, cfg, rotate) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.local, self.full = (
            RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *rope_of(hf, kind), rotate)
            for kind in ("sliding_attention", "full_attention"))

    def build(self) -> None:
        self.local.build()
        self.full.build()


class Gemma3DecoderLayer(nn.Module):
    """residual + post_norm(attn(pre_norm(residual))), then the same around the MLP. As in llama.py
    the residual add is deferred: a layer returns (its MLP's normed output, the stream so far)."""

    def __init__(self, cfg, impl: Implementations, tp: TensorParallel, layer: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding_window = layer_window(cfg, layer)
        self.local = local_layers(cfg.hf_config)[layer]  # rotates with the local table
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(cfg, impl, tp, self.sliding_window)  # qk_norm: llama's slots
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps)
        self.self_attn.scale = cfg.hf_config.query_pre_attn_scalar ** -0.5
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, cfg.intermediate_size, impl, cfg.quantization, tp)
        self.mlp.silu_and_mul = gelu_tanh_and_mul  # GeGLU: the same fused gate/up, another gate
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, residual, positions, rotary, kv_cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(x, residual, positions, rotary)
        o = self.self_attn.attend(q, k, v, kv_cache, meta)
        return self.after_attention(o, residual)

    def before_attention(self, x, residual, positions, rotary):
        residual = x if residual is None else x + residual
        return *self.self_attn.project(self.input_layernorm(residual), positions, rotary), residual

    def after_attention(self, o, residual) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + self.post_attention_layernorm(self.self_attn.o_proj(o.flatten(1)))
        x = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(x), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg, impl: Implementations, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, impl, tp, i)
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = GemmaRotary(cfg, impl.ops.rotary)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, impl: Implementations = READABLE, tp: TensorParallel = SINGLE) -> None:
        nn.Module.__init__(self)  # Llama's parts, with Gemma's model under them
        self.config, self.tp = cfg, tp
        self.model = Gemma3Model(cfg, impl, tp)
        rows = self.model.embed_tokens.rows
        self.lm_head = ColumnLinear(cfg.hidden_size, [rows * tp.size], False,
                                    method=UnquantizedLinearMethod(impl.linear.float), tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_logit_softcapping = getattr(cfg.hf_config, "final_logit_softcapping", None)

    @staticmethod
    def layer_options(hf_config) -> dict:
        return {**LlamaForCausalLM.layer_options(hf_config), "qk_norm": True,
                **gemma_options(hf_config)}

    @staticmethod
    def check_dtype(dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            raise ValueError("Gemma 3 does not run in float16: its activations overflow fp16's "
                             "range (inf/NaN logits); use dtype='bfloat16' (Ampere GPUs, CPUs) or "
                             "dtype='float32' (a T4 or any older GPU)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta) -> torch.Tensor:
        """As Llama's, with the embedding scaled and each layer's own rotary table."""
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as transformers (a Python float: no
        # host tensor inside a captured CUDA graph)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype).item()
        rotary, residual = self.model.rotary_emb, None
        for i, layer in enumerate(self.model.layers):
            slot, layer_meta = meta.for_layer(i)  # a local layer reads its group's tables
            table = rotary.local if layer.local else rotary.full
            x, residual = layer(x, residual, positions, table, kv_caches[slot], layer_meta)
        return self.model.norm(x + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
