"""The MoE feed-forward a decoder layer holds: the router, this rank's experts, their load.

model/moe.py is the computation (route, sort by expert, one block per expert, combine); this module
is the layer the decoder builds from it, for every family with experts (Mixtral, Qwen2-MoE,
Qwen3-MoE: their modules only say which layers are sparse and how the router renormalises).

* The router (`gate`, [E, H]) stays float whatever the format, as in vLLM, and every rank holds it
  whole: every rank routes every token, so every rank knows every token's experts.
* The experts (`FusedExperts`) are held once, stacked in model/moe.py's layout, at this rank's
  share. Under tensor parallelism (vLLM's default) every rank holds every expert, a slice of its
  intermediate dimension: the gate and up rows of the slice, the matching columns of down
  (model/moe_parallel.py's `tensor_parallel_shard`). Under expert parallelism
  (`enable_expert_parallel`) each rank holds whole experts, a contiguous range (`expert_range`:
  the first E % N ranks one more when N does not divide E), and runs only the rows routed to them.
* Combining: either way each rank's output is a partial sum over experts (TP: over slices of every
  expert, EP: over its own experts) for *every* token, and one all-reduce completes it: the
  all-gather + reduce the issue names, done as the one collective that does both. No dispatch is
  needed because attention here is tensor parallel, so every rank already holds every token's
  hidden state; an all-to-all (each token sent only to the ranks of its experts, and back) pays
  where ranks hold different tokens (data-parallel attention) and on fast interconnects, not for
  replicated activations on gloo, where it would move the same bytes in more messages.
* Int8 (`quantization="int8"`): each expert's weights are quantized as they load, one scale per
  output row (quantization/int8.py's method, or the learner's `EngineHooks.int8_quantize`, per
  expert block), and multiplied as int8 values.
* The load: `record_choices` keeps the step's router choices ([tokens, k]) in a buffer the runner
  reads after the forward pass, for the trace (tokens per expert per layer per step). Off (None),
  it costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel import SINGLE, TensorParallel
from minivllm.model.linear import ColumnLinear, RowLinear
from minivllm.model.moe import route, sort_by_expert
from minivllm.model.moe_parallel import expert_range, local_order
from minivllm.quantization import LinearKernels, QuantizationConfig
from minivllm.quantization.int8 import quantize_per_channel
from minivllm.quantization.unquantized import UnquantizedLinearMethod

# checkpoint names of an expert's projections -> which part of our stacked tensors they fill
EXPERT_PROJECTIONS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
                      "w2": "down", "down_proj": "down"}


class FusedExperts(nn.Module):
    """One layer's experts at this rank's share: gate_up_proj [E_r, 2 I_r, H], down_proj
    [E_r, H, I_r] (E_r: the experts it holds, I_r: the intermediate slice of each), filled one
    checkpoint tensor at a time by `load`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel = SINGLE, expert_parallel: bool = False,
                 quant: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.num_experts, self.tp, self.expert_parallel = num_experts, tp, expert_parallel
        if expert_parallel:
            if num_experts < tp.size:
                raise ValueError(f"enable_expert_parallel: {num_experts} experts cannot give each "
                                 f"of {tp.size} ranks one")
            self.experts = expert_range(num_experts, tp.rank, tp.size)
            self.inter = intermediate_size
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"tensor_parallel_size={tp.size} does not divide the experts' "
                                 f"intermediate size {intermediate_size} (enable_expert_parallel "
                                 f"gives each rank whole experts instead)")
            self.experts, self.inter = range(num_experts), intermediate_size // tp.size
        held = len(self.experts)
        self.gate_up_proj = nn.Parameter(torch.empty(held, 2 * self.inter, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(held, hidden_size, self.inter),
                                      requires_grad=False)
        self.int8 = quant is not None and quant.name == "int8"
        # a learner's own quantize_per_channel (EngineHooks.int8_quantize), as dense layers use it
        self.quantize = getattr(quant, "quantize", None) if self.int8 else None
        if quant is not None and not self.int8:
            raise ValueError(f"experts in {quant.name} format are not supported (float "
                             f"checkpoints, and quantization='int8' from them, are)")
        self.register_buffer("gate_up_scale", None)  # [E_r, 2 I_r], int8 only
        self.register_buffer("down_scale", None)  # [E_r, H]
        self.loaded: set[tuple[int, str]] = set()

    def rows_of(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of an expert's intermediate dimension (all of it under EP)."""
        if self.expert_parallel or self.tp.size == 1:
            return full
        return full.narrow(dim, self.tp.rank * self.inter, self.inter)

    def load(self, expert: int, projection: str, tensor: Callable[[], torch.Tensor],
             where: str = "") -> None:
        """One expert's gate, up or down weight (any of EXPERT_PROJECTIONS' names), as the
        checkpoint holds it ([I, H] or [H, I]); an expert another rank holds is not even read."""
        if expert not in self.experts:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"{where}: expert {expert} of a {self.num_experts}-expert layer")
            return
        part, local = EXPERT_PROJECTIONS[projection], expert - self.experts.start
        value = tensor()
        if part == "down":
            target, value = self.down_proj.data[local], self.rows_of(value, 1)
        else:
            first = 0 if part == "gate" else self.inter
            target = self.gate_up_proj.data[local, first:first + self.inter]
            value = self.rows_of(value, 0)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{where} has shape {tuple(value.shape)}, expected "
                             f"{tuple(target.shape)} (this rank's part)")
        target.copy_(value)
        self.loaded.add((expert, part))

    def load_fused(self, name: str, value: torch.Tensor, where: str = "") -> None:
        """A checkpoint that already stacks every expert (`experts.gate_up_proj` [E, 2I, H] or
        `experts.down_proj` [E, H, I], transformers 5.x's in-memory layout)."""
        mine = value[self.experts.start:self.experts.stop]
        for local, expert in enumerate(self.experts):
            if name == "down_proj":
                self.load(expert, "down", lambda e=mine[local]: e, where)
            else:
                gate, up = mine[local].chunk(2, dim=0)
                self.load(expert, "gate", lambda g=gate: g, where)
                self.load(expert, "up", lambda u=up: u, where)

    def missing(self) -> list[str]:
        """The (expert, part) pairs this rank holds that no checkpoint tensor filled."""
        return [f"expert {e} {part}" for e in self.experts for part in ("gate", "up", "down")
                if (e, part) not in self.loaded]

    def process_weights_after_loading(self) -> None:
        """Int8: each expert's rows quantized, one scale per output row; down's rows are split
        over the ranks under tensor parallelism, so its scale takes the max over all of them."""
        del self.loaded
        if not self.int8:
            return
        gate_up, down = self.gate_up_proj.data, self.down_proj.data
        down_absmax = down.float().abs().amax(dim=2)  # [E_r, H]
        if not self.expert_parallel:
            down_absmax = self.tp.all_reduce_max(down_absmax)
        if self.quantize is not None:  # the learner's, per expert block (as Int8LinearMethod)
            quantized = [self.quantize(w) for w in gate_up]
            quantized_down = [self.quantize(w) for w in down]
        else:
            quantized = [quantize_per_channel(w, w.dtype) for w in gate_up]
            quantized_down = [quantize_per_channel(w, w.dtype, m)
                              for w, m in zip(down, down_absmax)]
        self.gate_up_proj = nn.Parameter(torch.stack([q.to(torch.int8) for q, _ in quantized]),
                                         requires_grad=False)
        self.gate_up_scale = torch.stack([s.to(gate_up.dtype) for _, s in quantized])
        self.down_proj = nn.Parameter(torch.stack([q.to(torch.int8) for q, _ in quantized_down]),
                                      requires_grad=False)
        self.down_scale = torch.stack([s.to(down.dtype) for _, s in quantized_down])

    def extra_repr(self) -> str:
        return (f"experts={self.experts.start}..{self.experts.stop - 1} of {self.num_experts}, "
                f"intermediate={self.inter}, int8={self.int8}")


class MoeFeedForward(nn.Module):
    """A sparse MLP: route each token to `top_k` experts, run them, sum their outputs weighted by
    the router; Qwen2-MoE adds an always-on shared expert gated per token."""

    def __init__(self, cfg, linear: LinearKernels, moe_experts: Callable,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        float_weights = UnquantizedLinearMethod(linear.float)
        self.gate = ColumnLinear(cfg.hidden_size, [cfg.num_experts], False, method=float_weights)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                    tp, cfg.expert_parallel, cfg.quantization)
        self.run_experts = moe_experts  # the platform's (model/moe.py's signature)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            self.shared_expert = nn.ModuleDict({
                "gate_up_proj": ColumnLinear(cfg.hidden_size, [shared] * 2, False,
                                             cfg.quantization, linear, tp=tp),
                "down_proj": RowLinear(shared, [cfg.hidden_size], False, cfg.quantization,
                                       linear, tp=tp)})
            self.shared_expert_gate = ColumnLinear(cfg.hidden_size, [1], False,
                                                   method=UnquantizedLinearMethod(linear.float))
        # [rows, k]: the last forward's router choices, when recorded (a buffer: it follows the
        # layer wherever the layer is allocated, lazily loaded layers included)
        self.register_buffer("choices", None, persistent=False)

    def record_choices(self, rows: int | None) -> None:
        """Keep each forward's expert ids (the first `rows` tokens' at most) for the trace;
        None: stop (the default, costing nothing)."""
        self.choices = None if rows is None else torch.empty(
            rows, self.top_k, dtype=torch.int16, device=self.gate.weight.device)  # (a buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.choices is not None:
            kept = min(len(expert_ids), len(self.choices))
            self.choices[:kept].copy_(expert_ids[:kept])
        order = sort_by_expert(expert_ids, self.num_experts)
        experts = self.experts
        if experts.expert_parallel:  # only the rows routed to this rank's experts
            order = local_order(order, experts.experts)
        out = self.tp.all_reduce(self.run_experts(
            x, weights, order, experts.gate_up_proj, experts.down_proj, experts.gate_up_scale,
            experts.down_scale))
        if self.shared_expert is not None:
            s = self.shared_expert
            gate, up = s["gate_up_proj"](x).chunk(2, dim=-1)
            shared = s["down_proj"](F.silu(gate) * up)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out


def record_expert_choices(model: nn.Module, rows: int | None) -> bool:
    """Make every MoE layer of `model` keep its router choices for up to `rows` tokens a forward
    (None: stop). False when the model has no experts."""
    layers = [m for m in model.modules() if isinstance(m, MoeFeedForward)]
    for layer in layers:
        layer.record_choices(rows)
    return bool(layers)


def expert_load(model: nn.Module, num_tokens: int) -> list[tuple[int, ...]]:
    """Tokens routed to each expert in each MoE layer by the last forward's first `num_tokens`
    tokens (a CUDA graph pads the batch: the padding is not counted); [] without recording."""
    layers = [m for m in model.modules() if isinstance(m, MoeFeedForward)
              and m.choices is not None]
    if not layers:
        return []
    chosen = torch.stack([m.choices[:num_tokens] for m in layers]).long()  # [L, T, k]
    counts = torch.zeros(len(layers), layers[0].num_experts, dtype=torch.int64,
                         device=chosen.device)
    counts.scatter_add_(1, chosen.flatten(1), torch.ones_like(chosen.flatten(1)))
    return [tuple(row) for row in counts.tolist()]
