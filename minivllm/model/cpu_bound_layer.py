"""The cpu platform's decoder layer: `DecoderLayer.forward`'s ops and tensors, looked up once.

Why: at batch 1 a decode step is a few hundred small calls, and on a CPU their Python costs as
much as the work of some of them. A 135M Llama's fp32 step measured 38 ms, of which ~4 ms went to
nine module calls per layer, ~25 attribute lookups and three frames per matmul before any kernel
ran. Here each layer's weights, sizes and ops are looked up once, when the layer first runs (after
lazy loading's pre-hook has filled it). Where every matmul's kernel can be called from C++ (the
tiled float kernel, GGUF's blocks: `LinearKernel.native`), a decode step's layer is then one op,
model/cpu_decoder_layer.cpp, which calls the same kernels with nothing between them; otherwise
(int8, int4, oneDNN's layout) it is one flat Python function calling the platform's ops directly.
Either way: the same kernels in the same order on the same tensors, so a step's results are
bitwise those of the module path (tests/test_cpu_bound_layer.py).

Once every layer is one op, the stack is too (`BoundStack`, the model's own forward otherwise):
calling 30 layers from Python, each with 27 arguments to convert, cost about a millisecond of a
135M model's 11 ms decode step. It runs where the layers share one step's metadata (no groups of
sliding-window tables) and no hook watches a layer (lazy loading's is gone after the first step).

What it binds: a dense decoder layer (llama.py's `DecoderLayer` and the families built from it)
whose norms, rotary and SwiGLU are the cpu platform's fused ops (cpu_layer_ops.py) and whose
attention is the C++ kernel (attention/cpu_attention.py), on one process (no all-reduce). A cache
of another dtype than the activations (fp8), which the C++ attention does not read, sends a step to
the layer's own `forward`; a layer with experts, or under tensor parallelism, keeps it for good.
The cpu platform (platforms/cpu.py) binds the layers unless MINIVLLM_CPU_BOUND_LAYERS=0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from minivllm.attention.cpu_attention import CpuAttentionBackend
from minivllm.model import cpu_layer_ops
from minivllm.model.llama import MLP, DecoderLayer, LlamaForCausalLM


def can_bind(layer: nn.Module) -> bool:
    """A dense decoder layer on the cpu platform's fused ops and C++ attention, one process."""
    attn = getattr(layer, "self_attn", None)
    return (isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MLP)
            and type(attn.backend) is CpuAttentionBackend
            and layer.input_layernorm.norm is cpu_layer_ops.rms_norm
            and attn.o_proj.tp.size == 1)


def bind_decoder_layers(model: nn.Module) -> list[BoundLayer]:
    """Give every layer that `can_bind` its bound forward (an instance attribute shadowing the
    method), and a model that runs Llama's forward its `BoundStack` where every layer binds;
    returns the bound layers (empty: the model keeps its module path)."""
    layers = [layer for layer in model.model.layers if can_bind(layer)]
    bound = [BoundLayer(layer) for layer in layers]
    llama_forward = type(model).forward is LlamaForCausalLM.forward
    if bound and len(bound) == len(model.model.layers) and llama_forward:
        BoundStack(model, bound)
    return bound


class BoundLayer:
    """One layer's forward: bound on its first call; the module path for a cache it cannot read."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.run, self.native = layer, None, None
        layer.forward = self

    def __call__(self, x, residual, positions, rotary, kv_cache, meta):
        if kv_cache.dtype != x.dtype:
            return DecoderLayer.forward(self.layer, x, residual, positions, rotary, kv_cache, meta)
        if self.run is None:  # first use: lazy loading has filled the layer by now
            python = python_forward(self.layer)
            self.native = native_forward(self.layer, python)
            self.run = python if self.native is None else self.native
        return self.run(x, residual, positions, rotary.cos_sin, kv_cache, meta)


def attention_constants(attn: nn.Module) -> tuple:
    """What both forwards read of a layer's attention once: the q/k norms' weights and eps (None
    without them: Qwen3 has them, Llama not), the scale and the sliding window (-1: none)."""
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
    qk_eps = attn.q_norm.eps if attn.qk_norm else None
    window = -1 if attn.sliding_window is None else attn.sliding_window
    return q_norm, k_norm, qk_eps, attn.scale, window


class LayerConstants(NamedTuple):
    """A layer's constant arguments of decoder_layer, in its order (model/cpu_decoder_layer.cpp)."""

    weights: list[torch.Tensor]  # per part of the four matmuls (qkv, o, gate_up, down)
    biases: list[torch.Tensor | None]  # per matmul
    parts: list[int]  # per matmul: how many parts
    layouts: list[int]  # per part, and its GGUF type and outputs
    types: list[int]
    outputs: list[int]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int


def native_constants(layer: nn.Module) -> tuple[int, LayerConstants] | None:
    """(the most rows its matmuls take, the constant arguments of decoder_layer) where each of
    `layer`'s matmuls has a native part (the tiled float and GGUF kernels); None where one has
    none (int8, int4, oneDNN's layout)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    natives = [linear.quant_method.native(linear) for linear in linears]
    if any(parts is None for parts in natives):
        return None
    parts = [part for native in natives for part in native]
    q_norm, k_norm, qk_eps, scale, window = attention_constants(attn)
    return min(part.most_rows for part in parts), LayerConstants(
        [part.weight for part in parts], [linear.bias for linear in linears],
        [len(native) for native in natives], [part.layout for part in parts],
        [part.kernel_type for part in parts], [part.outputs for part in parts],
        layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
        layer.input_layernorm.eps, q_norm, k_norm, 0.0 if qk_eps is None else qk_eps,
        attn.num_heads, attn.num_kv_heads, attn.head_dim, scale, window)


def native_forward(layer: nn.Module, python: Callable) -> Callable | None:
    """`layer`'s forward as one C++ op (model/cpu_decoder_layer.cpp), `python` for more rows than
    its matmuls take; None where `native_constants` has none."""
    native = native_constants(layer)
    if native is None:
        return None
    most, constants = native
    op = torch.ops.minivllm_cpu.decoder_layer.default

    def forward(x, residual, positions, cos_sin, kv_cache, meta):
        if x.shape[0] > most:  # a prompt's rows: the kernels' `apply` takes them
            return python(x, residual, positions, cos_sin, kv_cache, meta)
        return op(x, residual, positions, cos_sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                  meta.block_tables, meta.seq_lens, meta.query_start_loc, *constants)

    forward.most, forward.constants = most, constants
    return forward


class BoundStack:
    """A Llama-forward model's forward with its layers as one op (decoder_layers), once every layer
    has bound as one; the model's own forward for a step the op cannot take."""

    def __init__(self, model: nn.Module, layers: list[BoundLayer]) -> None:
        self.model, self.layers, self.constants = model, layers, None
        self.most, self.dtype = 0, None  # bind() sets them with the constants
        model.forward = self

    def __call__(self, input_ids, positions, kv_caches, meta):
        inner = self.model.model
        if self.constants is None:
            self.bind()
        if not self.takes(input_ids, kv_caches, meta):
            return LlamaForCausalLM.forward(self.model, input_ids, positions, kv_caches, meta)
        x = inner.embed_tokens(input_ids)
        x, residual = torch.ops.minivllm_cpu.decoder_layers.default(
            x, positions, inner.rotary_emb.cos_sin, kv_caches, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, *self.constants)
        return inner.norm(x, residual)[0]

    def bind(self) -> None:
        """The layers' constants as decoder_layers takes them, once every layer runs as one op
        (each binds on its first call: until then the model's forward runs)."""
        natives = [bound.native for bound in self.layers]
        if any(native is None for native in natives):
            return
        each: list[LayerConstants] = [native.constants for native in natives]
        self.most = min(native.most for native in natives)
        self.dtype = each[0].input_norm.dtype  # the activations'
        lists = ("weights", "biases", "parts", "layouts", "types", "outputs")
        flat = [[item for c in each for item in getattr(c, field)] for field in lists]
        norms = [w for c in each for w in (c.input_norm, c.post_norm)]
        qk_norms = [w for c in each for w in (c.q_norm, c.k_norm)]
        floats = [float(v) for c in each for v in (c.eps, c.qk_eps, c.scale)]
        ints = [int(v) for c in each for v in (c.heads, c.kv_heads, c.head_dim, c.window)]
        self.constants = (*flat, norms, qk_norms, floats, ints)

    def takes(self, input_ids: torch.Tensor, kv_caches: torch.Tensor, meta) -> bool:
        """Whether decoder_layers can run this step: bound, few enough rows, one set of tables,
        the cache in the activations' dtype, and no hook to call on a layer."""
        return (self.constants is not None and input_ids.shape[0] <= self.most
                and meta.layer_places is None and kv_caches.dtype == self.dtype
                and not any(layer._forward_hooks or layer._forward_pre_hooks
                            for layer in self.model.model.layers)
                and not (nn.modules.module._global_forward_hooks
                         or nn.modules.module._global_forward_pre_hooks))


def python_forward(layer: nn.Module) -> Callable:
    """`layer`'s forward as one flat Python function over its ops and each matmul's `bind`."""
    attn, mlp = layer.self_attn, layer.mlp
    ops = torch.ops.minivllm_cpu
    norm, add_norm = ops.rms_norm.default, ops.add_rms_norm.default
    rotate, attend, silu_and_mul = (ops.rotary_embedding.default, ops.paged_attention.default,
                                    ops.silu_and_mul.default)
    eps, in_weight = layer.input_layernorm.eps, layer.input_layernorm.weight
    post_weight = layer.post_attention_layernorm.weight
    qkv, o_proj, gate_up, down = (linear.quant_method.bind(linear) for linear in
                                  (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    heads, dim = attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim
    split = [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads]
    q_norm, k_norm, qk_eps, scale, window = attention_constants(attn)

    def forward(x, residual, positions, cos_sin, kv_cache, meta):
        if residual is None:  # the first layer: nothing to add yet
            h, residual = norm(x, in_weight, eps), x
        else:
            h, residual = add_norm(x, residual, in_weight, eps)
        q, k, v = qkv(h).view(-1, heads, dim).split(split, dim=1)
        if q_norm is not None:
            q, k = norm(q, q_norm, qk_eps), norm(k, k_norm, qk_eps)
        rotate(positions, q, k, cos_sin)
        o = attend(q, k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables,
                   meta.seq_lens, meta.query_start_loc, scale, window)
        h, residual = add_norm(o_proj(o.flatten(1)), residual, post_weight, eps)
        return down(silu_and_mul(gate_up(h))), residual

    return forward
