"""EngineArgs (at vLLM's path): one table of engine arguments for `LLM(**kwargs)`, the CLI and the
server.

Every field is an argument with vLLM's name and (where minivllm has the knob) our default;
`add_cli_args` turns the table into flags (`max_num_seqs` -> `--max-num-seqs`, booleans as
`--x/--no-x`, as vLLM's do) and `from_cli_args` reads them back, so a flag, a keyword and a server
option cannot drift apart.

Two kinds of field. Most are EngineConfig's own knobs. The rest are vLLM arguments with no meaning
in a teaching engine (`pipeline_parallel_size`, `decode_context_parallel_size`, ...): a value that
asks for nothing we lack (1, None, "auto") is accepted and ignored; any other is refused with a
ValueError naming the argument. So is an unknown name, or a value of the wrong type: nothing ends in
a bare TypeError.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from minivllm.config import NGRAM, EngineConfig
from minivllm.core.scheduling_policy import POLICIES
from minivllm.hooks import EngineHooks
from minivllm.keyword_args import ANY, refuse_unknown_kwargs, same_value
from minivllm.quantization.kv_cache import ACCEPTED_KV_CACHE_DTYPES


def arg(default: Any, help: str = "", *, cli: bool = True, choices: tuple | None = None,
        short: str | None = None) -> Any:
    """A field of the table: its default, its --help text, and whether it is a CLI flag (Python
    objects are not)."""
    return field(default=default, metadata={"help": help, "cli": cli, "choices": choices,
                                            "short": short})


def vllm_arg(default: Any, accepts: tuple | list, help: str = "", short: str | None = None) -> Any:
    """A vLLM argument minivllm has no use for: the values in `accepts` (or ANY) are harmless,
    others refused."""
    return field(default=default, metadata={"help": help, "cli": True, "accepts": accepts,
                                            "short": short})


@dataclass
class EngineArgs:
    """vLLM's EngineArgs: every engine argument, checked when the args are made (a ValueError names
    the bad one)."""

    # ---- minivllm's knobs (EngineConfig's fields, its defaults) ----
    model: str | None = arg(None, "checkpoint directory or Hub repo id (default: minivllm-tiny)")
    served_model_name: str | list[str] | None = arg(
        None, "the name the server answers to (default: --model exactly as given)")
    tokenizer: str | None = arg(None, "tokenizer directory or Hub id (default: the model's)")
    revision: str | None = arg(None, "branch, tag or commit of a Hub model")
    tokenizer_revision: str | None = arg(None)
    download_dir: str | None = arg(None, "where Hub downloads go (default: the Hugging Face cache)")
    generation_config: str = arg(EngineConfig.generation_config, "'auto': the checkpoint's EOS ids "
                                 "and sampling defaults; 'vllm': ignore them",
                                 choices=("auto", "vllm"))
    dtype: str | torch.dtype = arg(EngineConfig.dtype, "weights and activations dtype",
                                   choices=("auto", "half", "float16", "bfloat16", "float",
                                            "float32"))
    kv_cache_dtype: str = arg(EngineConfig.kv_cache_dtype,
                              "KV cache elements: the model's dtype ('auto'), or fp8 "
                              "('fp8' = 'fp8_e4m3', 'fp8_e5m2'): twice the blocks",
                              choices=ACCEPTED_KV_CACHE_DTYPES)
    device: str = arg(EngineConfig.device, '"auto", "cpu", "cuda" or "cuda:N"')
    block_size: int = arg(EngineConfig.block_size, "tokens per KV cache block")
    num_kv_blocks: int | None = arg(None, "KV cache blocks (default: sized from memory)")
    kv_cache_memory_bytes: int | None = arg(None, "KV cache size in bytes")
    gpu_memory_utilization: float = arg(EngineConfig.gpu_memory_utilization,
                                        "share of GPU memory for weights, activations and KV cache")
    max_num_seqs: int = arg(EngineConfig.max_num_seqs, "most sequences in one batch")
    max_num_batched_tokens: int = arg(EngineConfig.max_num_batched_tokens, "most tokens a step")
    max_model_len: int | None = arg(None, "context length (default: the model's)")
    enable_chunked_prefill: bool = arg(EngineConfig.enable_chunked_prefill)
    enable_prefix_caching: bool = arg(EngineConfig.enable_prefix_caching)
    attention_backend: str = arg("auto", choices=("auto", "torch", "triton"))
    enforce_eager: bool = arg(EngineConfig.enforce_eager,
                              "no CUDA graphs for decode steps, no torch.compile on CPU")
    seed: int = arg(EngineConfig.seed)
    lazy_loading: bool = arg(EngineConfig.lazy_loading, "read each decoder layer's weights when a "
                             "step first runs it: a sooner start, a slower first request")
    cpu_threads: int | None = arg(None, "torch threads on CPU (default: the free cores)")
    max_logprobs: int = arg(EngineConfig.max_logprobs,
                            "most logprobs / prompt_logprobs a request may ask for (-1: no cap)")
    trace_steps: int = arg(EngineConfig.trace_steps, "recent steps the trace keeps (0: none)",
                           cli=False)
    speculative_model: str | None = arg(None, 'draft checkpoint directory, or "[ngram]"')
    num_speculative_tokens: int = arg(EngineConfig.num_speculative_tokens)
    prompt_lookup_max: int = arg(EngineConfig.prompt_lookup_max)
    prompt_lookup_min: int = arg(EngineConfig.prompt_lookup_min)
    speculative_config: dict | None = arg(None, 'vLLM\'s form, JSON: {"model": DIR or "method": '
                                          '"ngram", "num_speculative_tokens": K}')
    scheduling_policy: str = arg(EngineConfig.scheduling_policy, choices=POLICIES)
    round_robin_quantum: int = arg(EngineConfig.round_robin_quantum, "round_robin: tokens a "
                                   "request makes before it yields its slot to a waiting one")
    sjf_aging_steps: int = arg(EngineConfig.sjf_aging_steps, "sjf: steps a request waits before "
                               "it goes ahead of every younger one")
    preemption_mode: str = arg(EngineConfig.preemption_mode, choices=("recompute", "swap"))
    quantization: str | None = arg(EngineConfig.quantization,
                                   "int8 (weight-only, from a float checkpoint), or gptq/awq/gguf "
                                   "to insist on the checkpoint's own format (default: as it is)",
                                   short="-q")
    tensor_parallel_size: int = arg(EngineConfig.tensor_parallel_size, "split the model over this "
                                    "many processes (gloo on CPU, NCCL on GPUs)", short="-tp")
    data_parallel_size: int = arg(EngineConfig.data_parallel_size, "run this many engines, each "
                                  "with its own scheduler and KV cache, sharing one mapped copy "
                                  "of the weights (CPU); generate deals its prompts round-robin, "
                                  "the server sends each call to the least loaded engine",
                                  short="-dp")
    swap_space: float = arg(EngineConfig.swap_space, "GiB of host memory for swapped-out KV blocks")
    cpu_offload_gb: float = arg(EngineConfig.cpu_offload_gb, "GiB of weights a GPU keeps in host "
                                "memory, streaming each layer in (does nothing on a CPU)")
    logits_processors: list | None = arg(None, "vLLM v1 LogitsProcessor classes or 'module:Class' "
                                         "names", cli=False)
    hooks: EngineHooks | None = arg(None, cli=False)

    # ---- vLLM arguments that ask for nothing here when left at these values ----
    trust_remote_code: bool = vllm_arg(False, ANY, "accepted: minivllm runs its own code for every "
                                       "architecture")
    pipeline_parallel_size: int = vllm_arg(1, (1,), short="-pp")
    decode_context_parallel_size: int = vllm_arg(1, (1,))
    distributed_executor_backend: str | None = vllm_arg(None, (None, "uni", "mp"))
    load_format: str = vllm_arg("auto", ("auto", "safetensors"))
    tokenizer_mode: str = vllm_arg("auto", ("auto", "hf"))
    skip_tokenizer_init: bool = vllm_arg(False, (False,))
    task: str | None = vllm_arg(None, (None, "auto", "generate"))
    runner: str = vllm_arg("auto", ("auto", "generate"))
    convert: str = vllm_arg("auto", ("auto", "none"))
    model_impl: str = vllm_arg("auto", ("auto",))
    code_revision: str | None = vllm_arg(None, (None,))
    hf_token: bool | str | None = vllm_arg(None, (None, True, False),
                                           "minivllm reads the token from the environment")
    hf_overrides: dict | None = vllm_arg(None, (None, {}))
    rope_scaling: dict | None = vllm_arg(None, (None, {}))
    rope_theta: float | None = vllm_arg(None, (None,))
    mm_processor_kwargs: dict | None = vllm_arg(None, ANY, "accepted: a text-only model has no "
                                                "processor to pass on to")
    limit_mm_per_prompt: dict | None = vllm_arg(None, ANY, "accepted: a text-only model takes no "
                                                "images to limit")
    disable_chunked_mm_input: bool = vllm_arg(False, ANY)
    enable_prompt_embeds: bool = vllm_arg(False, (False,))
    logprobs_mode: str = vllm_arg("raw_logprobs", ("raw_logprobs",))
    num_gpu_blocks_override: int | None = vllm_arg(None, (None,), "ours: --num-kv-blocks")
    enable_lora: bool = vllm_arg(False, (False,))
    enable_sleep_mode: bool = vllm_arg(False, (False,))
    async_scheduling: bool = vllm_arg(False, (False,))
    calculate_kv_scales: bool = vllm_arg(False, (False,))
    kv_transfer_config: dict | None = vllm_arg(None, (None,))
    override_generation_config: dict | None = vllm_arg(None, (None, {}))
    additional_config: dict | None = vllm_arg(None, (None, {}))
    compilation_config: Any = vllm_arg(None, ANY, "accepted and ignored: minivllm compiles nothing")
    cuda_graph_sizes: list | None = vllm_arg(None, (None,))
    max_seq_len_to_capture: int | None = vllm_arg(None, ANY)
    disable_sliding_window: bool = vllm_arg(False, ANY, "minivllm caps max_model_len at a sliding "
                                            "window anyway")
    disable_cascade_attn: bool = vllm_arg(False, ANY)
    disable_custom_all_reduce: bool = vllm_arg(False, ANY)
    disable_async_output_proc: bool = vllm_arg(False, ANY)
    disable_log_stats: bool = vllm_arg(False, ANY)
    max_parallel_loading_workers: int | None = vllm_arg(None, ANY)
    use_tqdm_on_load: bool = vllm_arg(True, ANY)
    worker_cls: str = vllm_arg("auto", ("auto",))

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, (list, tuple)):
            if len(self.served_model_name) != 1:
                raise ValueError(f"served_model_name: minivllm serves one name, got "
                                 f"{self.served_model_name!r}")
            self.served_model_name = self.served_model_name[0]
        hints = _hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_instance(value, hints[f.name]):
                raise ValueError(f"{f.name} must be {_type_name(hints[f.name])}, got {value!r}")
            accepts = f.metadata.get("accepts")
            if accepts not in (None, ANY) and not any(same_value(value, a) for a in accepts):
                raise ValueError(f"{f.name}={value!r} is not supported by minivllm (it accepts "
                                 f"only {', '.join(repr(a) for a in accepts)})")

    # ---- building the engine ---------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these args ask for (vLLM-only arguments checked above and dropped)."""
        config = {f.name: getattr(self, f.name) for f in fields(EngineConfig)
                  if f.init and f.name != "model_config"}
        config.update(speculative_kwargs(self.speculative_config))
        if self.hooks is None:
            del config["hooks"]
        return EngineConfig(**config)

    # ---- the command line ------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add a flag for every CLI field (vLLM's spelling); returns the parser, as vLLM's does."""
        group = parser.add_argument_group("engine arguments",
                                          "the same names as LLM(...)'s keyword arguments")
        hints = _hints(cls)
        for f in fields(cls):
            if f.metadata.get("cli", False) and not _has_flag(parser, f.name):
                names = [f"--{f.name.replace('_', '-')}"] + ([f.metadata["short"]]
                                                             if f.metadata.get("short") else [])
                group.add_argument(*names, dest=f.name, default=f.default,
                                   **_cli_kwargs(f, hints[f.name]))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The args a parsed command line holds (fields it has no flag for keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs: the engine's arguments plus the async front end's own."""

    enable_log_requests: bool = vllm_arg(False, ANY, "accepted: the server's request events go to "
                                         "the minivllm.server.requests logger either way")
    disable_log_requests: bool = vllm_arg(True, ANY, "vLLM's older spelling of "
                                          "--no-enable-log-requests")


refuse_unknown_kwargs(EngineArgs)  # EngineArgs(foo=1) is a ValueError naming foo, not a TypeError
refuse_unknown_kwargs(AsyncEngineArgs)


def engine_config_from_kwargs(model: Any, kwargs: dict[str, Any]) -> EngineConfig:
    """An EngineConfig from LLM()'s arguments, vLLM's spellings included."""
    return EngineArgs(model=model, **kwargs).create_engine_config()


def speculative_kwargs(spec: dict | None) -> dict[str, Any]:
    """vLLM's speculative_config dict -> our speculative_model / num_speculative_tokens (/ n-gram
    sizes)."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    spec = dict(spec)
    method, model = spec.pop("method", None), spec.pop("model", None)
    out = {"num_speculative_tokens": spec.pop("num_speculative_tokens", None)}
    if out["num_speculative_tokens"] is None:
        raise ValueError("speculative_config needs num_speculative_tokens")
    if method in ("ngram", NGRAM) or model == NGRAM:
        out["speculative_model"] = NGRAM
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if name in spec:
                out[name] = spec.pop(name)
    elif method in (None, "draft_model") and model is not None:
        out["speculative_model"] = model
    else:
        raise ValueError(f"speculative_config: minivllm supports a draft 'model' or method "
                         f"'ngram', got method={method!r}, model={model!r}")
    if spec:
        raise ValueError(f"speculative_config: unsupported keys {sorted(spec)}")
    return out


# ---- reading the type hints ----------------------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, {"Path": Path, "torch": torch, "EngineHooks": EngineHooks,
                                       "Any": Any})


def _options(hint: Any) -> tuple:
    """`int | None` -> (int, NoneType); a plain hint -> (hint,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_instance(value: Any, hint: Any) -> bool:
    for option in _options(hint):
        if option is Any or (option is type(None) and value is None):
            return True
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if base is int and isinstance(value, bool):
            continue
        if base is str and isinstance(value, Path):  # a path is as good as its string
            return True
        if isinstance(base, type) and isinstance(value, base):
            return True
    return False


def _type_name(hint: Any) -> str:
    names = [getattr(typing.get_origin(o) or o, "__name__", str(o)) for o in _options(hint)]
    return " or ".join("None" if name == "NoneType" else name for name in names)


def _has_flag(parser: argparse.ArgumentParser, dest: str) -> bool:
    # a command that defines one itself keeps its own
    return any(a.dest == dest for a in parser._actions)


def _cli_kwargs(f, hint: Any) -> dict[str, Any]:
    options = [o for o in _options(hint) if o is not type(None)]
    help_text = f.metadata.get("help") or ""
    if f.metadata.get("accepts") not in (None, ANY):
        accepted = ", ".join(map(str, f.metadata["accepts"]))
        help_text = f"{help_text} (minivllm accepts only {accepted})".strip()
    kw: dict[str, Any] = {"help": help_text or None}
    if bool in options:
        kw["action"] = argparse.BooleanOptionalAction
    elif list in [typing.get_origin(o) or o for o in options] and f.name == "served_model_name":
        kw.update(nargs="+", metavar="NAME")
    elif any((typing.get_origin(o) or o) in (dict, list) for o in options) or Any in options:
        kw["type"] = _json_value
    elif int in options:
        kw["type"] = human_readable_int
    elif float in options:
        kw["type"] = float
    if f.metadata.get("choices"):
        kw["choices"] = f.metadata["choices"]
    return kw


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e.msg})") from None


def human_readable_int(text: str) -> int:
    """'2048', or with vLLM's suffixes: '32k' (x1000), '32K' (x1024), 'm'/'M', 'g'/'G'."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        return int(number)
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: no decimals with binary suffixes (did you "
                                             f"mean {number}{suffix.lower()}?)")
        return int(number) * 1024 ** "KMG".index(suffix.upper()) * 1024
    return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
