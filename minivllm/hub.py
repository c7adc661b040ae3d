"""Turn what a learner types for vLLM (`LLM("HuggingFaceTB/SmolLM2-360M-Instruct")`) into a local
directory: a Hub id is fetched with `snapshot_download` into the normal Hugging Face cache (shared
with vLLM and transformers). Every failure becomes a ValueError naming the id and what to do."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from minivllm import envs
from minivllm.quantization.gguf import is_gguf

# What the engine reads: the config, safetensors weights (sharded or not) and the tokenizer. Nothing
# else (no *.bin / *.pt / *.gguf duplicates of the weights, no README or images) is downloaded.
CONFIG_FILES = ["config.json", "generation_config.json"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json"]


def resolve_model_path(name_or_path: str | os.PathLike, revision: str | None = None,
                       download_dir: str | os.PathLike | None = None, what: str = "model") -> Path:
    """The directory itself, or the cached Hub snapshot of that repo id (`revision` and
    `download_dir` apply to Hub ids only). `what` words the errors; a "tokenizer" downloads no
    weights."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if is_gguf(path) and what != "draft model":  # one file holds config, tokenizer and weights
            return path
        raise ValueError(f"{what} path {path} is a file, not a directory (nor a GGUF model file)")
    if not _is_repo_id(name_or_path):
        raise ValueError(f"{what} directory not found: {path}")
    repo_id = str(name_or_path)
    ref = f"{what} {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    cache = Path(download_dir).expanduser() if download_dir is not None else _default_cache_dir()
    snapshot = _download(repo_id, revision, cache, what, ref)
    _check_snapshot(snapshot, ref, what)
    return snapshot


def _download(repo_id: str, revision: str | None, cache: Path, what: str, ref: str) -> Path:
    """snapshot_download of the files we read, each failure a ValueError that says what to do."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; a learner may set it later
    offline = envs.HF_HUB_OFFLINE or bool(constants.HF_HUB_OFFLINE)
    patterns = CONFIG_FILES + TOKENIZER_FILES + ([] if what == "tokenizer" else WEIGHT_FILES)
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                                      allow_patterns=patterns,
                                                      local_files_only=offline))
    except GatedRepoError as e:  # a subclass of RepositoryNotFoundError, so it comes first
        raise ValueError(f"{ref} is gated on the Hugging Face Hub: request access at "
                         f"https://huggingface.co/{repo_id}, then give a token (set HF_TOKEN, or "
                         f"run `hf auth login`)") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"{ref} not found on the Hugging Face Hub, nor as a local directory (if "
                         f"it is private, give a token: set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"revision {revision!r} not found in {what} {repo_id!r} on the Hugging "
                         f"Face Hub") from e
    # nothing (or only part of it) in the cache, and no Hub to ask
    except LocalEntryNotFoundError as e:
        if offline:
            raise ValueError(f"HF_HUB_OFFLINE is set and {ref} is not in the cache at {cache}: "
                             f"unset HF_HUB_OFFLINE to download it, or pass a local "
                             f"directory") from e
        raise _unreachable(ref, cache) from e
    except _network_errors() as e:
        raise _unreachable(ref, cache) from e
    except HfHubHTTPError as e:  # anything else the Hub answered (401, disabled repo, server error)
        raise ValueError(f"could not download {ref} from the Hugging Face Hub: {e}") from e


def _is_repo_id(name: str | os.PathLike) -> bool:
    """Whether huggingface_hub itself accepts `name` as "org/name" or "name" (a Path never is)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        return isinstance(name, str) and validate_repo_id(name) is None
    except HFValidationError:
        return False


def _default_cache_dir() -> Path:
    """The HF cache as the environment says now (huggingface_hub read it once, at its import)."""
    from huggingface_hub import constants

    env = envs.HF_HUB_CACHE or (envs.HF_HOME and os.path.join(envs.HF_HOME, "hub"))
    return Path(os.path.expandvars(env or constants.HF_HUB_CACHE)).expanduser()


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of whichever HTTP client this huggingface_hub version uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("requests", "ConnectionError"), ("requests", "Timeout"),
                         ("httpx", "TransportError"), ("httpx2", "TransportError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _unreachable(ref: str, cache: Path) -> ValueError:
    return ValueError(f"the Hugging Face Hub could not be reached and {ref} is not in the cache at "
                      f"{cache}: check the network connection, or pass a local directory")


def _check_snapshot(snapshot: Path, ref: str, what: str) -> None:
    """Fail here, naming the repo, rather than later with a bare path: the engine loads only
    safetensors."""
    has_config = (snapshot / "config.json").is_file()
    if what == "tokenizer":
        if not has_config and not any((snapshot / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{ref} has neither tokenizer files nor a config.json (snapshot at "
                             f"{snapshot})")
        return
    if not has_config:
        raise ValueError(f"{ref} has no config.json (snapshot at {snapshot}): only safetensors "
                         "checkpoints are supported")
    if not any(snapshot.glob("*.safetensors")):
        raise ValueError(f"{ref} has no *.safetensors weights (snapshot at {snapshot}): only "
                         f"safetensors checkpoints are supported")
