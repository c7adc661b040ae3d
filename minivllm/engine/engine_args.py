"""vLLM's constructor arguments, so code written for `vllm.LLM(...)` runs here or says clearly why not.

`LLM(**kwargs)` takes our EngineConfig fields, plus vLLM arguments that have no meaning in a one-GPU teaching
engine: those are accepted where the value asks for nothing we lack (`pipeline_parallel_size=1`,
`trust_remote_code=True` for an architecture we implement ourselves) and refused with a ValueError that names
the argument otherwise. Nothing ends in a bare TypeError.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from minivllm.config import NGRAM, EngineConfig

ANY = object()  # any value is harmless

# vLLM argument -> the values that ask for nothing beyond what minivllm does (ANY: every value)
HARMLESS: dict[str, Any] = {
    "trust_remote_code": ANY,  # we run our own code for the architectures we support, never the checkpoint's
    "pipeline_parallel_size": {1}, "data_parallel_size": {1},
    "tokenizer_mode": {"auto"}, "skip_tokenizer_init": {False},
    "load_format": {"auto", "safetensors"}, "cpu_offload_gb": {0}, "hf_overrides": {None},
    "mm_processor_kwargs": {None}, "logits_processors": {None},
    "disable_log_stats": ANY, "disable_custom_all_reduce": ANY, "max_seq_len_to_capture": ANY,
    "compilation_config": ANY, "disable_async_output_proc": ANY, "max_logprobs": ANY,
    "task": {"auto", "generate"}, "runner": {"auto", "generate"}, "kv_cache_dtype": {"auto"},
}


def engine_config_from_kwargs(model: Any, kwargs: dict[str, Any]) -> EngineConfig:
    """An EngineConfig from LLM()'s arguments, vLLM's spellings included."""
    known = {f.name for f in fields(EngineConfig)} - {"model_config"}
    config: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name == "speculative_config":
            config.update(speculative_kwargs(value))
        elif name in known:
            config[name] = value
        elif name in HARMLESS:
            allowed = HARMLESS[name]
            if allowed is not ANY and value not in allowed:
                accepted = sorted(allowed, key=str)
                raise ValueError(f"{name}={value!r} is not supported by minivllm (it accepts {accepted})")
        else:
            raise ValueError(f"LLM() got an unknown argument {name!r}; minivllm accepts {sorted(known)}, "
                             f"speculative_config and these vLLM arguments: {sorted(HARMLESS)}")
    return EngineConfig(model=model, **config)


def speculative_kwargs(spec: dict | None) -> dict[str, Any]:
    """vLLM's speculative_config dict -> our speculative_model / num_speculative_tokens (/ n-gram sizes)."""
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
        raise ValueError(f"speculative_config: minivllm supports a draft 'model' or method 'ngram', "
                         f"got method={method!r}, model={model!r}")
    if spec:
        raise ValueError(f"speculative_config: unsupported keys {sorted(spec)}")
    return out
