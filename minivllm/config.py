"""EngineConfig: every engine knob in one place, checked before anything is loaded.

`resolve()` settles everything that depends on the checkpoint (its config, the dtype, max_model_len)
before any part of the engine is built, so every part reads the same final values and none changes
them later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from minivllm import envs
from minivllm.core.kv_groups import KVCacheGroups, kv_cache_groups
from minivllm.core.kv_sizing import DEFAULT_CPU_KV_CACHE_BYTES, kv_bytes_per_block
from minivllm.core.scheduling_policy import POLICIES
from minivllm.distributed.parallel import check_divisible, local_kv_heads
from minivllm.hooks import EngineHooks
from minivllm.hub import resolve_model_path
from minivllm.model import read_model_config
from minivllm.model.loader import ModelConfig
from minivllm.platforms.cpu_hardware import default_cpu_dtype
from minivllm.quantization import resolve_quantization
from minivllm.quantization.kv_cache import (
    ACCEPTED_KV_CACHE_DTYPES,
    check_kv_cache_dtype,
    kv_cache_torch_dtype,
)
from minivllm.sampling.logits_processor import load_logits_processor_classes

# package data (pyproject.toml): a checkout and an installed wheel find the embedded models alike
DEFAULT_MODEL = Path(__file__).resolve().parent / "data" / "models" / "minivllm-tiny"
DEFAULT_DRAFT_MODEL = DEFAULT_MODEL.parent / "minivllm-tiny-draft"  # its speculative partner
# a Qwen3-MoE (8 experts, 2 per token) as active per token as the draft (chapter 14)
DEFAULT_MOE_MODEL = DEFAULT_MODEL.parent / "minivllm-tiny-moe"
# speculative_model's name for n-gram (prompt lookup) drafting: no draft model at all
NGRAM = "[ngram]"


def arg(default: Any = None, help: str = "", *, cli: bool = True, choices: tuple | None = None,
        short: str | None = None, **kwargs: Any) -> Any:
    """A knob of the table: its default, its --help text (the why), its choices and whether it is a
    CLI flag (Python objects are not). EngineArgs (engine/arg_utils.py) copies these fields, so a
    knob, its keyword and its flag are written once."""
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    return field(metadata={"help": help, "cli": cli, "choices": choices, "short": short}, **kwargs)


@dataclass
class EngineConfig:
    model: str | Path | None = arg(None, "checkpoint directory, .gguf file or Hub repo id "
                                   "(default: minivllm-tiny)")
    tokenizer: str | Path | None = arg(None, "tokenizer directory or Hub id (default: the model's)")
    revision: str | None = arg(None, "branch, tag or commit of a Hub model")
    tokenizer_revision: str | None = arg(None)
    download_dir: str | Path | None = arg(None, "where Hub downloads go (default: the HF cache)")
    generation_config: str = arg("auto", "'auto': the checkpoint's EOS ids and sampling defaults; "
                                 "'vllm': ignore them", choices=("auto", "vllm"))
    served_model_name: str | None = arg(None, "the name the server answers to (default: --model "
                                        "exactly as given)")
    dtype: str | torch.dtype = arg("auto", "weights and activations dtype", choices=(
        "auto", "half", "float16", "bfloat16", "float", "float32"))
    quantization: str | None = arg(None, "int8 (weight-only, from a float checkpoint), or gptq/awq/"
                                   "gguf to insist on the checkpoint's own format (default: as it "
                                   "is; quantization/__init__.py lists every spelling)", short="-q")
    kv_cache_dtype: str = arg("auto", "KV cache elements: the model's dtype ('auto'), or fp8 "
                              "('fp8' = 'fp8_e4m3', 'fp8_e5m2', scaled per layer): 2x the blocks",
                              choices=ACCEPTED_KV_CACHE_DTYPES)
    device: str = arg("auto", '"auto", "cpu", "cuda" or "cuda:N"')
    block_size: int = arg(16, "tokens per KV cache block")
    num_kv_blocks: int | None = arg(None, "KV cache blocks (default: sized from memory)")
    kv_cache_memory_bytes: int | None = arg(None, "KV cache size in bytes")
    gpu_memory_utilization: float = arg(0.9, "share of GPU memory for weights, activations and KV "
                                        "cache")
    max_num_seqs: int = arg(256, "most sequences in one batch")
    max_num_batched_tokens: int = arg(2048, "most tokens a step")
    max_model_len: int | None = arg(None, "context length (default: the model's)")
    enable_chunked_prefill: bool = arg(True)
    enable_prefix_caching: bool = arg(True)
    attention_backend: str = arg("auto", choices=("auto", "torch", "triton"))
    enforce_eager: bool = arg(False, "no CUDA graphs for decode steps, no torch.compile on CPU")
    lazy_loading: bool = arg(False, "read each decoder layer's weights when a step first runs it: "
                             "a sooner start, a slower first request")
    cpu_offload_gb: float = arg(0, "GiB of weights a GPU keeps in host memory, streaming each "
                                "layer in (does nothing on a CPU)")
    seed: int = arg(0)
    cpu_threads: int | None = arg(None, "torch threads on CPU (default: the free cores)")
    max_logprobs: int = arg(20, "most logprobs / prompt_logprobs a request asks for (-1: no cap)")
    trace_steps: int = arg(1000, "recent steps the trace keeps (0: none)", cli=False)
    speculative_model: str | Path | None = arg(None, 'draft checkpoint directory, or "[ngram]"')
    num_speculative_tokens: int = arg(0)
    prompt_lookup_max: int = arg(4, "n-gram drafting: the longest suffix looked up")
    prompt_lookup_min: int = arg(1, "n-gram drafting: the shortest suffix looked up")
    scheduling_policy: str = arg("fcfs", "priority: lower value first (vLLM's)", choices=POLICIES)
    round_robin_quantum: int = arg(16, "round_robin: tokens a request makes before it yields its "
                                   "slot to a waiting one")
    sjf_aging_steps: int = arg(256, "sjf: steps a request waits before it goes ahead of every "
                               "younger one")
    preemption_mode: str = arg("recompute", "what a preempted request loses: its blocks, or "
                               "'swap' them out", choices=("recompute", "swap"))
    swap_space: float = arg(4, "GiB of host memory for swapped-out KV blocks")
    logits_processors: list | None = arg(None, "vLLM v1 LogitsProcessor classes or 'module:Class' "
                                         "names", cli=False)
    tensor_parallel_size: int = arg(1, "split the model over this many processes (gloo on CPU, "
                                    "NCCL on GPUs)", short="-tp")
    enable_expert_parallel: bool = arg(False, "a mixture of experts' layers give each tensor-"
                                       "parallel rank whole experts, not a slice of every expert")
    data_parallel_size: int = arg(1, "run this many engines, each with its own scheduler and KV "
                                  "cache, sharing one mapped copy of the weights (CPU); generate "
                                  "deals its prompts round-robin, the server sends each call to "
                                  "the least loaded engine", short="-dp")
    hooks: EngineHooks = arg(cli=False, default_factory=EngineHooks, repr=False)  # a learner's own
    model_config: ModelConfig | None = field(default=None, repr=False)  # set by resolve()

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = DEFAULT_MODEL
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("generation_config", "attention_backend", "scheduling_policy",
                     "preemption_mode"):
            choices = self.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "round_robin_quantum",
                     "sjf_aging_steps", "tensor_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or an integer >= 0, got "
                             f"{self.max_logprobs!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name in ("cpu_offload_gb", "swap_space"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative number of GiB, got "
                                 f"{getattr(self, name)!r}")
        if self.logits_processors:  # a bad entry fails here, naming itself
            load_logits_processor_classes(self.logits_processors)
        if self.tensor_parallel_size > 1 and self.hooks != EngineHooks():
            raise ValueError("hooks= run in this process only: they need tensor_parallel_size=1")
        self._check_speculation()
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        """What data parallelism's first version runs with (the device resolved)."""
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
        if dp == 1:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 is not "
                             "supported: each data-parallel engine runs the whole model itself")
        if self.hooks != EngineHooks():
            raise ValueError("hooks= run in this process only: they need data_parallel_size=1")
        if not self.device.startswith("cpu"):
            raise ValueError(f"data_parallel_size > 1 runs on the CPU only (the engines share one "
                             f"memory-mapped copy of the weights), not on {self.device!r}")

    def _check_speculation(self) -> None:
        """Speculative decoding's settings, and the features it cannot be combined with."""
        if self.speculative_model is None:
            return
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1 when speculative_model is set, "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.logits_processors:
            raise ValueError("logits_processors cannot be combined with speculative decoding: "
                             "drafts are verified without them")
        if self.speculative_model == NGRAM:
            return
        if self.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' does not swap a draft model's cache: use "
                             "'recompute' with a draft speculative_model")
        if self.tensor_parallel_size > 1:
            raise ValueError("a draft speculative_model is not split across ranks: with "
                             "tensor_parallel_size > 1 use n-gram drafting ('[ngram]') or none")

    def resolve(self) -> EngineConfig:
        """A copy with Hub ids turned into local directories, the checkpoint's config read, the
        dtype chosen and max_model_len fixed (a GPU's cache is sized later, by profiling: a request
        that could outgrow it is refused when it arrives)."""
        model = resolve_model_path(self.model, self.revision, self.download_dir)
        tokenizer = model if self.tokenizer is None else resolve_model_path(
            self.tokenizer, self.tokenizer_revision, self.download_dir, "tokenizer")
        draft = self.speculative_model
        if draft not in (None, NGRAM):
            draft = resolve_model_path(draft, None, self.download_dir, "draft model")
        mc = self.model_config or read_model_config(model)
        quantization = resolve_quantization(self.quantization, mc.quantization, mc.gguf, str(model))
        learner_int8 = self.hooks.int8_quantize
        if quantization is not None and quantization.name == "int8" and learner_int8 is not None:
            quantization = replace(quantization, quantize=learner_int8)  # a learner's (chapter 12)
        tp = self.tensor_parallel_size
        mc = replace(mc, quantization=quantization,
                     expert_parallel=bool(self.enable_expert_parallel) and tp > 1)
        if tp > 1 and self.device.startswith("cuda") and envs.RANK is None:  # (torchrun: any nodes)
            gpus = torch.cuda.device_count()
            if gpus < tp:
                raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs on this machine (one "
                                 f"per rank), but it has {gpus}: use fewer ranks, torchrun across "
                                 f"machines, or device='cpu'")
        dtype = self.resolve_dtype(mc.torch_dtype)
        if tp > 1:
            check_divisible(mc, tp)
            if mc.quantization is not None and mc.quantization.name in ("gptq", "awq"):
                raise ValueError(f"tensor_parallel_size={tp} with a {mc.quantization.name.upper()} "
                                 f"checkpoint is not supported (float checkpoints, GGUF files and "
                                 f"quantization='int8' are)")
        max_len = self._max_model_len(mc, dtype)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller "
                             f"than max_model_len ({max_len}): without chunked prefill a long "
                             f"prompt could never be scheduled. Raise max_num_batched_tokens, "
                             f"lower max_model_len, or enable chunked prefill")
        # vLLM's rule: the server answers to the model as given; the embedded default to its name
        name = self.served_model_name or (DEFAULT_MODEL.name if self.model is DEFAULT_MODEL
                                          else str(self.model))
        return replace(self, model=model, tokenizer=tokenizer, served_model_name=name,
                       speculative_model=draft, model_config=mc, dtype=dtype, max_model_len=max_len)

    def _max_model_len(self, mc: ModelConfig, dtype: torch.dtype) -> int:
        """The asked max_model_len, checked against the model's positions (a sliding window limits
        what a layer looks back, not the length); by default all of them, capped by what the KV
        cache holds where that is known before loading (num_kv_blocks, or a byte budget)."""
        max_len = self.max_model_len
        limit, why = mc.max_position_embeddings, "max_position_embeddings"
        if max_len is not None and max_len > limit:
            raise ValueError(f"max_model_len {max_len} exceeds the model's {why} {limit}")
        if max_len is not None:
            return max_len
        blocks = self.num_kv_blocks
        groups = kv_cache_groups(mc.num_layers, mc.sliding_window, mc.sliding_layers)
        if blocks is None and (self.kv_cache_memory_bytes or not self.device.startswith("cuda")):
            kv_heads = local_kv_heads(mc.num_kv_heads, self.tensor_parallel_size)
            itemsize = kv_cache_torch_dtype(self.kv_cache_dtype, dtype).itemsize
            per_block = kv_bytes_per_block(groups.group_size, self.block_size, kv_heads,
                                           mc.head_dim, itemsize)
            blocks = self.cpu_kv_cache_bytes // per_block
        if blocks is not None:  # a block of tokens takes a block of every group
            blocks //= groups.num_groups
        return limit if blocks is None else min(limit, blocks * self.block_size)

    @property
    def cpu_kv_cache_bytes(self) -> int:
        """The KV budget where no GPU is profiled: `kv_cache_memory_bytes`, else vLLM's CPU knob
        VLLM_CPU_KVCACHE_SPACE (GiB, as a vLLM user sets it for `vllm serve`), else the default."""
        space = envs.VLLM_CPU_KVCACHE_SPACE
        return self.kv_cache_memory_bytes or (space << 30 if space else DEFAULT_CPU_KV_CACHE_BYTES)

    @property
    def kv_groups(self) -> KVCacheGroups:
        """The layers' KV-cache groups (core/kv_groups.py), once the model config is read."""
        mc = self.model_config
        if mc is None:
            raise ValueError("kv_groups needs a resolved config (EngineConfig.resolve)")
        return kv_cache_groups(mc.num_layers, mc.sliding_window, mc.sliding_layers)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type (the model's dtype, or fp8), once dtype is resolved."""
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError("cache_dtype needs a resolved config (EngineConfig.resolve)")
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """On CPU bf16 where it is native, else float32 (vLLM-CPU's rule); on CUDA the checkpoint's
        half type, bf16 only where the GPU supports it (sm >= 8.0). Pass dtype="float32" for results
        equal to transformers'."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            names = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16,
                     "bfloat16": torch.bfloat16, "float": torch.float32, "fp32": torch.float32,
                     "fp16": torch.float16, "bf16": torch.bfloat16}
            if self.dtype not in names:
                raise ValueError(f"dtype must be 'auto' or one of {sorted(names)}, got "
                                 f"{self.dtype!r}")
            return names[self.dtype]
        if not self.device.startswith("cuda"):
            return default_cpu_dtype()
        forced = envs.MINIVLLM_CUDA_DTYPE  # bench/gpu_check.sh: float16, as on a T4, on any GPU
        if forced:
            return getattr(torch, forced)
        bf16_ok = torch.cuda.get_device_capability(torch.device(self.device))[0] >= 8
        if checkpoint_dtype == torch.bfloat16 or checkpoint_dtype in (None, torch.float32):
            return torch.bfloat16 if bf16_ok else torch.float16
        return torch.float16


# vLLM's name for the config its logits processors receive (the fields are ours)
VllmConfig = EngineConfig
