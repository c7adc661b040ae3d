"""What a platform supplies: every choice of implementation the engine makes, made once.

vLLM asks a global `current_platform` and lets each op pick `forward_cpu` or `forward_cuda` when it
runs. Here the choice is an object the runner builds once (platforms/__init__.py: `choose_platform`)
and hands down: the model is built from its `Implementations` (the small ops, the attention backend,
one linear kernel per format family) and names no hardware; the runner asks it whether to compile,
whether to capture CUDA graphs and how to size CPU threads. A platform holds no mutable global
state, so two engines in one process may run on different platforms (a test comparing the reference
with the cpu platform does). `op_table()` names the function behind each op, for a chapter's table
and for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.attention.online_softmax import OnlineSoftmaxBackend
from minivllm.attention.torch_backend import TorchAttentionBackend
from minivllm.model.layer_ops import REFERENCE, LayerOps
from minivllm.model.llama import DecoderLayer, Implementations
from minivllm.model.moe import grouped_experts
from minivllm.platforms.cpu_hardware import CpuThreadSizer, torch_default_threads
from minivllm.quantization import REFERENCE_KERNELS, LinearKernels
from minivllm.quantization.gguf import gguf_tensors

if TYPE_CHECKING:
    from minivllm.model.compiled import CompiledLayers


def qualified_name(obj) -> str:
    """`module.qualname` of a function, or of an object's class."""
    obj = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


class Platform:
    """The readable defaults; each platform replaces what it has faster (cpu.py, cuda.py)."""

    name = "reference"
    # op (as op_table names it) -> the test that runs this platform's implementation against the
    # reference one; the reference itself is held to transformers (tests/test_equality.py)
    tested_by: dict[str, str] = {}

    def __init__(self, device: str | torch.device, dtype: torch.dtype,
                 online_softmax_update=None) -> None:
        """`online_softmax_update`: a learner's own (minivllm.hooks, chapter 02), with which decode
        steps are attended block by block (attention/online_softmax.py), whatever the platform."""
        self.device, self.dtype = torch.device(device), dtype
        self.online_softmax_update = online_softmax_update
        self.ops: LayerOps = REFERENCE
        self.linear: LinearKernels = REFERENCE_KERNELS
        self.attention: AttentionBackend = self._hooked(TorchAttentionBackend())
        # a MoE layer's experts given the routing sorted by expert (model/moe.py's signature)
        self.moe_experts = grouped_experts

    def _hooked(self, attention: AttentionBackend) -> AttentionBackend:
        """`attention`, unless the learner's online-softmax update replaces it."""
        update = self.online_softmax_update
        return attention if update is None else OnlineSoftmaxBackend(update)

    @property
    def implementations(self) -> Implementations:
        return Implementations(ops=self.ops, attention=self.attention, linear=self.linear,
                               moe_experts=self.moe_experts)

    def compile(self, model: torch.nn.Module, enforce_eager: bool) -> CompiledLayers | list | None:
        """Compile (or bind) the model's layers in place where a platform does (cpu.py); None:
        the modules run as built."""
        return None

    def captures_graphs(self, enforce_eager: bool) -> bool:
        """Whether decode steps are recorded as CUDA graphs (runner/cuda_graphs.py): cuda.py's."""
        return False

    def thread_sizer(self, fixed: int | None, ranks: int = 1) -> CpuThreadSizer | None:
        """On a CPU, torch's threads follow the cores other processes leave free (ranks share them),
        unless `fixed` (EngineConfig.cpu_threads) sets them; None elsewhere."""
        if self.device.type != "cpu":
            return None
        return CpuThreadSizer(fixed=fixed, max_threads=max(1, torch_default_threads() // ranks))

    def op_table(self) -> dict[str, str]:
        """Each op -> the qualified name of the function (or class) that implements it here."""
        table = {"attention": qualified_name(self.attention),
                 **{op: qualified_name(fn) for op, fn in self.ops._asdict().items()}}
        for family, kernel in self.linear._asdict().items():
            if kernel is None:  # no kernel for GGUF's blocks here: the loader dequantizes them
                table[f"linear[{family}]"] = table[f"linear[{family}].layout"] = qualified_name(
                    gguf_tensors)
                continue
            table[f"linear[{family}]"] = qualified_name(type(kernel).apply)
            table[f"linear[{family}].layout"] = qualified_name(type(kernel).layout)
        table["moe_experts"] = qualified_name(self.moe_experts)
        table["decoder_layer"] = self.decoder_layer_name()
        table["compile"] = self.compiler_name()
        table["cuda_graphs"] = ("minivllm.runner.cuda_graphs.DecodeGraphs"
                                if self.captures_graphs(enforce_eager=False) else "none")
        return table

    def decoder_layer_name(self) -> str:
        """What runs a decode step's decoder layer, for op_table: the model's own method, unless
        `compile` replaces it (cpu.py binds each layer's ops into one function)."""
        return qualified_name(DecoderLayer.forward)

    def compiler_name(self) -> str:
        """What `compile` runs, for op_table: "none" unless a platform compiles."""
        return "none"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, dtype={self.dtype})"
