"""EngineConfig: every engine knob in one place, checked before anything is loaded.

`resolve()` settles everything that depends on the checkpoint (its config, the dtype, max_model_len)
before any part of the engine is built, so every part reads the same final values and none changes
them later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from minivllm import envs
from minivllm.core.kv_sizing import DEFAULT_CPU_KV_CACHE_BYTES, kv_bytes_per_block
from minivllm.core.scheduling_policy import POLICIES
from minivllm.distributed.parallel import check_divisible, local_kv_heads
from minivllm.hooks import EngineHooks
from minivllm.hub import resolve_model_path
from minivllm.model import read_model_config
from minivllm.model.loader import ModelConfig
from minivllm.platforms.cpu_hardware import default_cpu_dtype
from minivllm.quantization import resolve_quantization
from minivllm.quantization.kv_cache import check_kv_cache_dtype, kv_cache_torch_dtype
from minivllm.sampling.logits_processor import load_logits_processor_classes

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "data" / "models" / "minivllm-tiny"
DEFAULT_DRAFT_MODEL = DEFAULT_MODEL.parent / "minivllm-tiny-draft"  # its speculative partner
# speculative_model's name for n-gram (prompt lookup) drafting: no draft model at all
NGRAM = "[ngram]"


@dataclass
class EngineConfig:
    # a local directory, a .gguf file or a Hub repo id; None: the embedded model
    model: str | Path | None = None
    tokenizer: str | Path | None = None  # None: the model's own
    revision: str | None = None  # of a Hub model: branch, tag or commit
    tokenizer_revision: str | None = None
    download_dir: str | Path | None = None  # where Hub downloads go (default: the HF cache)
    # "auto": the checkpoint's EOS ids and sampling defaults; "vllm": ignore them
    generation_config: str = "auto"
    # the name the server answers to (default: `model` exactly as given)
    served_model_name: str | None = None
    dtype: str | torch.dtype = "auto"
    # None: as the checkpoint is (float, GPTQ, AWQ, GGUF); "int8": weight-only int8 quantized at
    # load (see minivllm/quantization/__init__.py for every accepted spelling)
    quantization: str | None = None
    # the KV cache's elements: "auto" (the model's dtype), or "fp8" (= "fp8_e4m3") / "fp8_e5m2" with
    # a per-tensor scale per layer: twice the blocks for the same bytes (quantization/kv_cache.py)
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    # True: no CUDA graphs (CUDA + Triton), no torch.compile (CPU: model/compiled.py)
    enforce_eager: bool = False
    # decoder layers read from the checkpoint when a step first runs them (model/lazy_loading.py)
    lazy_loading: bool = False
    # GiB of the decoder layers' weights a GPU streams from host memory (runner/weight_offload.py)
    cpu_offload_gb: float = 0
    seed: int = 0
    # CPU only: None sizes torch's threads to the cores left free (platforms/cpu_hardware.py)
    cpu_threads: int | None = None
    # vLLM's: the most logprobs / prompt_logprobs a request may ask for (-1: no cap)
    max_logprobs: int = 20
    trace_steps: int = 1000  # how many recent steps the step trace keeps (0: none)
    speculative_model: str | Path | None = None  # a draft checkpoint (or Hub id), NGRAM, or None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4  # n-gram drafting: the longest and shortest suffix looked up
    prompt_lookup_min: int = 1
    # "fcfs", "priority" (vLLM's: lower value first), "sjf" or "round_robin" (scheduling_policy.py)
    scheduling_policy: str = "fcfs"
    round_robin_quantum: int = 16  # "round_robin": tokens a request makes before it yields its slot
    sjf_aging_steps: int = 256  # "sjf": steps of waiting after which a request goes ahead of others
    preemption_mode: str = "recompute"  # what a preempted request loses: its blocks, or "swap"
    # GiB of host memory for swapped-out blocks (vLLM's name and default); used by "swap"
    swap_space: float = 4
    # vLLM v1 logits processors: LogitsProcessor subclasses or "module:Class" names
    logits_processors: list | None = None
    # ranks the model is split over: this process is rank 0, N - 1 worker processes the others
    tensor_parallel_size: int = 1
    # whole engines (each its scheduler and KV cache) that share one mapped copy of the weights and
    # split the requests (engine/data_parallel.py); CPU only, one rank each, no hooks
    data_parallel_size: int = 1
    hooks: EngineHooks = field(default_factory=EngineHooks, repr=False)  # a learner's own parts
    model_config: ModelConfig | None = field(default=None, repr=False)  # set by resolve()

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = DEFAULT_MODEL
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got "
                             f"{self.generation_config!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "round_robin_quantum",
                     "sjf_aging_steps"):
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
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}")
        if not isinstance(self.cpu_offload_gb, (int, float)) or self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a non-negative number of GiB, got "
                             f"{self.cpu_offload_gb!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got "
                             f"{self.swap_space!r}")
        if self.logits_processors:  # a bad entry fails here, naming itself
            load_logits_processor_classes(self.logits_processors)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got "
                             f"{self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.hooks != EngineHooks():
            raise ValueError("hooks= run in this process only: they need tensor_parallel_size=1")
        self._check_speculation()
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._check_data_parallel()
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got "
                             f"{self.attention_backend!r}")

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
        dtype chosen and max_model_len fixed.

        max_model_len defaults to the model's window, capped by what the KV cache can hold where
        that is known before loading (num_kv_blocks, or a byte budget off the GPU). A GPU's cache is
        sized by profiling; a request that could outgrow it is refused when it arrives
        (InputProcessor).
        """
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
        mc = replace(mc, quantization=quantization)
        tp = self.tensor_parallel_size
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
        """The asked max_model_len, checked against the model's window; by default the window,
        capped by what the KV cache holds where that is known before loading (num_kv_blocks, or a
        byte budget)."""
        max_len = self.max_model_len
        limit, why = mc.max_position_embeddings, "max_position_embeddings"
        if mc.sliding_window is not None and mc.sliding_window < limit:
            limit = mc.sliding_window
            why = "sliding_window (sliding-window attention is not implemented)"
        if max_len is not None and max_len > limit:
            raise ValueError(f"max_model_len {max_len} exceeds the model's {why} {limit}")
        if max_len is not None:
            return max_len
        blocks = self.num_kv_blocks
        if blocks is None and (self.kv_cache_memory_bytes or not self.device.startswith("cuda")):
            kv_heads = local_kv_heads(mc.num_kv_heads, self.tensor_parallel_size)
            itemsize = kv_cache_torch_dtype(self.kv_cache_dtype, dtype).itemsize
            per_block = kv_bytes_per_block(mc.num_layers, self.block_size, kv_heads, mc.head_dim,
                                           itemsize)
            blocks = (self.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block
        return limit if blocks is None else min(limit, blocks * self.block_size)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache tensors' element type (the model's dtype, or fp8): once resolved, as dtype
        is then final."""
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
