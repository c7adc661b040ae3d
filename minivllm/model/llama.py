"""A Llama-family decoder that reads and writes a paged KV cache.

One class covers Llama/TinyLlama and Mistral (plain), Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each
head of q and k). Unlike the Hugging Face model it sees the step's tokens as one flat list (no padding):
requests are told apart only by the attention metadata. q/k/v and gate/up are fused into one matmul each.
Every matmul is a linear layer from model/linear.py, whose weights a quantization method holds (float, int8,
GPTQ, AWQ: minivllm/quantization/); embeddings and the LM head stay float, as in those formats.

Under tensor parallelism (`tp`) each rank builds the same model at its share: its attention heads (q/k/v
column-parallel, split per head; KV heads replicated when fewer than the ranks), its slice of the MLP, its
rows of the vocabulary. Two all-reduces per layer (o_proj, down_proj) and one in the embedding; the logits
are all-gathered, so every rank holds the full logits and samples the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backend import LayerKernels
from minivllm.attention.metadata import AttentionMetadata
from minivllm.distributed.parallel import SINGLE, TensorParallel, kv_head_replicas, local_kv_heads
from minivllm.model.embedding import VocabParallelEmbedding
from minivllm.model.linear import ColumnLinear, RowLinear
from minivllm.model.rotary import RotaryEmbedding
from minivllm.quantization.unquantized import UnquantizedLinearMethod


class RMSNorm(nn.Module):
    """norm(x), or with a residual: (norm(x + residual), x + residual), the add deferred from the layer before.

    With the backend's `kernels` (Triton's, or the CPU's C++ ops) either is one fused kernel
    (minivllm/kernels/norm.py, model/cpu_layer_ops.py).
    """

    def __init__(self, dim: int, eps: float, kernels: LayerKernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernels.rms_norm if kernels else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            out, residual = self.kernel(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg, backend, kernels: LayerKernels | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        triton = backend.name == "triton"  # quantized matmuls launch Triton kernels too
        self.head_dim = hd = cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, local_kv_heads(cfg.num_kv_heads, tp.size)
        quant, kv_copies = cfg.quantization, kv_head_replicas(cfg.num_kv_heads, tp.size)
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [cfg.num_heads * hd] + [cfg.num_kv_heads * hd] * 2,
                                     cfg.qkv_bias, quant, triton, tp=tp, replicas=[1, kv_copies, kv_copies])
        self.o_proj = RowLinear(cfg.num_heads * hd, [cfg.hidden_size], False, quant, triton, tp=tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.scale = self.head_dim**-0.5
        # an fp8 KV cache stores K / k_scale and V / v_scale (1.0 unless the checkpoint gives them; a float cache
        # ignores them): see minivllm/quantization/kv_cache.py
        self.k_scale = self.v_scale = 1.0
        self.backend = backend

    def project(self, x, rope, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's queries, keys and values, [T, heads, dim], q and k rotated to their positions."""
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)  # rows of heads
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(rope, q, k)
        return q, k, v

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Store k, v in the cache, attend every query over its request's context: [T, heads, dim]."""
        return self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, kernels: LayerKernels | None = None, quant=None,
                 tp: TensorParallel = SINGLE, triton: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, [intermediate, intermediate], False, quant, triton, tp=tp)
        self.down_proj = RowLinear(intermediate, [hidden], False, quant, triton, tp=tp)
        self.kernel = kernels.silu_and_mul if kernels else None  # silu(gate) * up in one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None:
            return self.down_proj(self.kernel(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(...)); each residual add is left to the next norm, which fuses it."""

    def __init__(self, cfg, backend, kernels: LayerKernels | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, backend, kernels, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, kernels, cfg.quantization, tp,
                       triton=backend.name == "triton")

    def forward(self, x, residual, rope, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(x, residual, rope, rotary)
        o = self.self_attn.attend(q, k, v, kv_cache, meta)
        return self.after_attention(o, residual)

    # Attention reads and writes the paged cache; everything around it is a pure function of its inputs, which
    # is what model/compiled.py hands to torch.compile on CPU.
    def before_attention(self, x, residual, rope, rotary):
        """Norm (adding the residual the layer before deferred), then q, k, v: (q, k, v, residual)."""
        if residual is None:  # the first layer: nothing to add yet
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        return *self.self_attn.project(x, rope, rotary), residual

    def after_attention(self, o, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, the residual add deferred into the next norm, then the MLP: (x, residual)."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(o.flatten(1)), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, backend, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # fused norm, rotary and SwiGLU kernels, if the backend brings them: the Triton backend its Triton kernels,
        # the torch backend on CPU C++ ops (model/cpu_layer_ops.py); None keeps the readable torch ops below
        kernels = getattr(backend, "layer_kernels", None)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, kernels, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling, kernels.apply_rotary if kernels else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, backend, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = LlamaModel(cfg, backend, tp)
        rows = self.model.embed_tokens.rows  # the vocab split like the embedding's, padded to N equal shards
        self.lm_head = ColumnLinear(cfg.hidden_size, [rows * tp.size], False, method=UnquantizedLinearMethod(), tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: [layers, 2, blocks, block_size, kv_heads, dim] -> [T, hidden]."""
        x, residual = self.model.embed_tokens(input_ids), None
        rotary = self.model.rotary_emb
        rope = rotary.for_positions(positions, x.dtype)  # the same cos/sin rows for every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, rotary, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab] float logits; under tensor parallelism every rank's vocab shard, gathered (padding cut)."""
        logits = self.tp.all_gather(self.lm_head(hidden))
        return (logits if self.tp.size == 1 else logits[:, : self.config.vocab_size]).float()
