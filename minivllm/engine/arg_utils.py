"""EngineArgs (at vLLM's path): one table of engine arguments for `LLM(**kwargs)`, the CLI and the
server.

Every field is an argument with vLLM's name and (where minivllm has the knob) our default;
`add_cli_args` turns the table into flags (`max_num_seqs` -> `--max-num-seqs`, booleans as
`--x/--no-x`, as vLLM's do) and `from_cli_args` reads them back, so a flag, a keyword and a server
option cannot drift apart.

Most fields are EngineConfig's own knobs, copied from its table (name, type, default, help), so
they are written once. The rest are vLLM arguments with no meaning in a teaching engine
(`pipeline_parallel_size`, ...): a value that asks for nothing we lack (1, None, "auto") is accepted
and ignored; any other is refused with a ValueError naming the argument. So is an unknown name, or a
value of the wrong type: nothing ends in a bare TypeError.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm.config import NGRAM, EngineConfig
from minivllm.hooks import EngineHooks
from minivllm.keyword_args import ANY, refuse_unknown_kwargs, same_value


def vllm_arg(default: Any, accepts: tuple | list, help: str = "", short: str | None = None) -> Any:
    """A vLLM argument minivllm has no use for: the values in `accepts` (or ANY) are harmless,
    others refused."""
    return field(default=default, metadata={"help": help, "cli": True, "accepts": accepts,
                                            "short": short})


@dataclass
class _VllmArgs:
    """vLLM's arguments that are no EngineConfig knob: speculative_config (translated into ours),
    then the ones accepted only at a value that asks for nothing."""

    speculative_config: dict | None = field(default=None, metadata={
        "help": 'vLLM\'s form, JSON: {"model": DIR or "method": "ngram", "num_speculative_tokens": '
                'K}', "cli": True})
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
    disable_sliding_window: bool = vllm_arg(False, (False,), "minivllm attends within each "
                                            "layer's window")
    disable_cascade_attn: bool = vllm_arg(False, ANY)
    disable_custom_all_reduce: bool = vllm_arg(False, ANY)
    disable_async_output_proc: bool = vllm_arg(False, ANY)
    disable_log_stats: bool = vllm_arg(False, ANY)
    max_parallel_loading_workers: int | None = vllm_arg(None, ANY)
    use_tqdm_on_load: bool = vllm_arg(True, ANY)
    worker_cls: str = vllm_arg("auto", ("auto",))


class _EngineArgsMethods:
    """EngineArgs' behaviour; its fields are EngineConfig's knobs and _VllmArgs'."""

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


def _engine_args_fields() -> list[tuple[str, Any, Any]]:
    """EngineConfig's knobs (name, type, default, help), then the vLLM-only arguments."""
    own = {"served_model_name": "str | list[str] | None",  # vLLM's list form, one name in it
           "hooks": "EngineHooks | None"}  # None: EngineConfig's empty EngineHooks()
    out = [(f.name, own.get(f.name, f.type),
            field(default=None if f.name == "hooks" else f.default, metadata=f.metadata))
           for f in fields(EngineConfig) if f.name != "model_config"]
    return out + [(f.name, f.type, field(default=f.default, metadata=f.metadata))
                  for f in fields(_VllmArgs)]


EngineArgs = make_dataclass("EngineArgs", _engine_args_fields(), bases=(_EngineArgsMethods,),
                            namespace={"__module__": __name__, "__doc__": (
                                "vLLM's EngineArgs: every engine argument, checked when the args "
                                "are made (a ValueError names the bad one).")})


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
    """'2048', or with vLLM's suffixes: '32k' (x1000), '32K' (x1024), 'm'/'M', 'g'/'G'; decimals
    only with the decimal (lower-case) ones."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kmg]?)", text.strip(), re.IGNORECASE)
    number, suffix = match.groups() if match else ("", "")
    if match is None or ("." in number and not suffix.islower()):
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (no decimals, bar k, m, g)")
    if suffix.isupper():
        return int(number) * 1024 ** ("KMG".index(suffix) + 1)
    return int(float(number) * 1000 ** ("kmg".index(suffix) + 1)) if suffix else int(number)
