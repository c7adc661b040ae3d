"""A Llama-family decoder that reads and writes a paged KV cache.

This module is the Llama family and the shared parts the other families declare their decoders
from: Mistral (mistral.py), Qwen2 (bias on q/k/v, qwen2.py) and Qwen3 (RMSNorm on each head of q
and k, qwen3.py) differ from Llama only in the `layer_options` they read from their config;
so do the mixture-of-experts families (mixtral.py, qwen2_moe.py, qwen3_moe.py), whose options say
which layers' MLP is sparse (model/moe_layer.py). registry.py maps a checkpoint's `architectures`
to its family.

Unlike the Hugging Face model it sees the step's tokens as one flat list (no padding): requests are
told apart only by the attention metadata. q/k/v and gate/up are fused into one matmul each. Every
matmul is a linear layer from model/linear.py, whose weights a quantization method holds (float,
int8, GPTQ, AWQ: minivllm/quantization/); embeddings and the LM head stay float, as in those
formats.

The model names no hardware: it is built from `Implementations` (a platform, minivllm/platforms/,
supplies them): its small ops (layer_ops.py), its attention backend and the matmul of each linear
layer's format. With the defaults it is the readable torch code throughout.

Under tensor parallelism (`tp`) each rank builds the same model at its share: its attention heads
(q/k/v column-parallel, split per head; KV heads replicated when fewer than the ranks), its slice of
the MLP, its rows of the vocabulary. Two all-reduces per layer (o_proj, down_proj) and one in the
embedding; the logits are all-gathered, so every rank samples the same tokens from the same logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.metadata import AttentionMetadata
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.distributed.parallel import SINGLE, TensorParallel, kv_head_replicas, local_kv_heads
from minivllm.model.embedding import VocabParallelEmbedding
from minivllm.model.layer_ops import REFERENCE, LayerOps
from minivllm.model.linear import ColumnLinear, RowLinear
from minivllm.model.moe import grouped_experts
from minivllm.model.moe_layer import MoeFeedForward
from minivllm.model.rotary import RotaryEmbedding
from minivllm.quantization import REFERENCE_KERNELS, LinearKernels
from minivllm.quantization.unquantized import UnquantizedLinearMethod


class Implementations(NamedTuple):
    """What the model is built from: one implementation of each op it runs."""

    ops: LayerOps = REFERENCE  # norm, rotary, SwiGLU
    attention: AttentionBackend = TorchAttentionBackend()
    linear: LinearKernels = REFERENCE_KERNELS  # each format family's layout and matmul
    moe_experts: Callable = grouped_experts  # a MoE layer's experts, given the sorted routing


READABLE = Implementations()  # the torch code the chapters print, everywhere


class RMSNorm(nn.Module):
    """norm(x), or with a residual: (norm(x + residual), x + residual), the add deferred from the
    layer before. `ops.rms_norm` computes either (layer_ops.py, or a platform's fused op)."""

    def __init__(self, dim: int, eps: float, ops: LayerOps = REFERENCE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.norm = ops.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, residual = self.norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


def layer_window(cfg, layer: int) -> int | None:
    """The tokens layer `layer` may look back (None: the whole context): the config's window on
    the layers that slide (all of them unless `sliding_layers` names some)."""
    layers = getattr(cfg, "sliding_layers", None)
    return cfg.sliding_window if layers is None or layers[layer] else None


class Attention(nn.Module):
    def __init__(self, cfg, impl: Implementations = READABLE, tp: TensorParallel = SINGLE,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # this layer's window (None: full attention)
        self.head_dim = hd = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, tp.size)
        quant, kv_copies = cfg.quantization, kv_head_replicas(cfg.num_kv_heads, tp.size)
        sizes = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
        self.qkv_proj = ColumnLinear(cfg.hidden_size, sizes, cfg.qkv_bias, quant, impl.linear,
                                     tp=tp, replicas=[1, kv_copies, kv_copies])
        self.o_proj = RowLinear(sizes[0], [cfg.hidden_size], False, quant, impl.linear, tp=tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, impl.ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, impl.ops)
        self.scale = self.head_dim**-0.5
        # an fp8 KV cache stores K / k_scale and V / v_scale (1.0 unless the checkpoint gives them;
        # a float cache ignores them): see minivllm/quantization/kv_cache.py
        self.k_scale = self.v_scale = 1.0
        self.backend = impl.attention

    def project(self, x, positions, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's q, k, v [T, heads, dim], q and k rotated to their positions."""
        heads = self.num_heads + 2 * self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, heads, self.head_dim)  # rows of heads
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        return q, k, v

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Store k, v in the cache, attend each query over its request's context [T, heads, dim]."""
        return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                    self.k_scale, self.v_scale, self.sliding_window)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, impl: Implementations = READABLE, quant=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, [intermediate] * 2, False, quant, impl.linear,
                                         tp=tp)
        self.down_proj = RowLinear(intermediate, [hidden], False, quant, impl.linear, tp=tp)
        self.silu_and_mul = impl.ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


def is_sparse(cfg, layer: int) -> bool:
    """Whether layer `layer`'s MLP is a mixture of experts (model/moe_layer.py): the config has
    experts, on the layers `moe_layers` marks (all of them unless it says otherwise)."""
    layers = getattr(cfg, "moe_layers", None)
    return bool(getattr(cfg, "num_experts", 0)) and (layers is None or layers[layer])


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(...)); each residual add is left to the next norm, which
    fuses it. The MLP is dense, or sparse (a mixture of experts) where the config says so."""

    def __init__(self, cfg, impl: Implementations = READABLE, tp: TensorParallel = SINGLE,
                 sliding_window: int | None = None, sparse: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, impl.ops)
        self.self_attn = Attention(cfg, impl, tp, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, impl.ops)
        self.mlp = (MoeFeedForward(cfg, impl.linear, impl.moe_experts, tp) if sparse
                    else MLP(cfg.hidden_size, cfg.intermediate_size, impl, cfg.quantization, tp))

    def forward(self, x, residual, positions, rotary, kv_cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(x, residual, positions, rotary)
        o = self.self_attn.attend(q, k, v, kv_cache, meta)
        return self.after_attention(o, residual)

    # Attention reads and writes the paged cache; everything around it is a pure function of its
    # inputs, which is what model/compiled.py hands to torch.compile on CPU.
    def before_attention(self, x, residual, positions, rotary):
        """Norm (adding the residual the layer before deferred), then (q, k, v, residual)."""
        if residual is None:  # the first layer: nothing to add yet
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(x, positions, rotary), residual

    def after_attention(self, o, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, its residual add deferred to the next norm, the MLP: (x, residual)."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(o.flatten(1)), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, impl: Implementations = READABLE, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, impl, tp, layer_window(cfg, i),
                                                 is_sparse(cfg, i))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, impl.ops)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling, impl.ops.rotary)


class LlamaForCausalLM(nn.Module):
    # (checkpoint name part, ours) pairs the loader replaces in every tensor name (Mixtral's)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg, impl: Implementations = READABLE, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = LlamaModel(cfg, impl, tp)
        rows = self.model.embed_tokens.rows  # the embedding's vocab split: N equal shards, padded
        self.lm_head = ColumnLinear(cfg.hidden_size, [rows * tp.size], False,
                                    method=UnquantizedLinearMethod(impl.linear.float), tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @staticmethod
    def layer_options(hf_config) -> dict:
        """What this family's layers read from a transformers config (ModelConfig's fields of the
        same names): Llama has a q/k/v bias only where `attention_bias` says so, no q/k norm, and
        attends to the whole context."""
        return {"qkv_bias": bool(getattr(hf_config, "attention_bias", False)), "qk_norm": False,
                "sliding_window": None}

    @staticmethod
    def check_dtype(dtype: torch.dtype) -> None:
        """A ValueError where this family cannot run in `dtype` (every dtype serves Llama)."""

    def share_tied_weight(self) -> None:
        """After loading: a tied head whose platform replaced the plain weight by a faster layout
        lends that layout to the embedding, which looks rows up there: the weight is held once."""
        head, embedding = self.lm_head, self.model.embed_tokens
        if head.tied and head.weight is not embedding.weight:
            embedding.read_rows_from(head.weight, functools.partial(head.quant_method.rows, head))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [layers, 2, blocks, block_size, kv_heads, dim]
        (a hybrid model's: [layers per group, ...], each layer's slot and tables from `meta`).
        Returns the last layer's normed hidden states, [T, hidden]."""
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            slot, layer_meta = meta.for_layer(i)
            x, residual = layer(x, residual, positions, self.model.rotary_emb, kv_caches[slot],
                                layer_meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab] float logits (under tensor parallelism all ranks' shards, padding cut)."""
        logits = self.tp.all_gather(self.lm_head(hidden))
        return (logits if self.tp.size == 1 else logits[:, : self.config.vocab_size]).float()
