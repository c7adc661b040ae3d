"""Hub ids resolve through a Hugging Face cache built here on disk, so nothing is ever downloaded.

HF_HUB_OFFLINE=1 is set for every test; the "Hub unreachable" and Hub-error messages are tested by
replacing huggingface_hub.snapshot_download with a function that raises, never by a real request.
"""

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from minivllm.hub import resolve_model_path
from minivllm.model import read_model_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hf_cache(checkpoint: Path, cache: Path, repo_id: str, commit: str = COMMIT,
                    skip: tuple = ()) -> Path:
    """Store a local checkpoint dir in the Hub cache layout; returns the snapshot dir.

    <cache>/models--<org>--<name>/blobs/<sha256>, refs/main = the commit hash (no newline:
    huggingface_hub reads it verbatim), snapshots/<commit>/<file> -> ../../blobs/<sha256>.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(checkpoint.iterdir()):
        if not file.is_file() or file.name in skip:
            continue
        sha = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / sha)
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", sha))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def hub_error(cls: type[Exception], message: str = "from the Hub") -> Exception:
    """An instance of a huggingface_hub HTTP error without an HTTP response (its __init__ wants one,
    and the response class differs between huggingface_hub versions)."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    """No test may reach the Hub, nor read or write the user's real cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


@pytest.fixture
def cache(tmp_path, llama_path) -> Path:
    cache = tmp_path / "cache"
    add_to_hf_cache(llama_path, cache, "tiny-org/tiny-llama")
    return cache


def test_local_dir_is_returned_unchanged(llama_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a,
                        **k: pytest.fail("Hub used for a dir"))
    assert resolve_model_path(llama_path) == llama_path
    assert resolve_model_path(str(llama_path), revision="v1") == llama_path


@pytest.mark.parametrize("name", ["./does/not/exist", "/abs/nope", "a/b/c", "../x",
                                  Path("plain-name")])
def test_missing_local_path(name, tmp_path, monkeypatch):
    # relative names resolve here, where nothing exists ("../x" is tmp_path/a/x)
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="model directory not found: .*"):
        resolve_model_path(name)


def test_existing_file_is_not_a_model(llama_path):
    with pytest.raises(ValueError, match="is a file, not a directory"):
        resolve_model_path(llama_path / "config.json")


def test_repo_id_from_download_dir(cache):
    snapshot = resolve_model_path("tiny-org/tiny-llama", download_dir=cache)
    assert snapshot == (cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT).resolve()
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    # the snapshot (symlinks into blobs/) loads like any checkpoint dir
    config = read_model_config(snapshot)
    assert config.model_type == "llama" and config.num_layers == 3


def test_repo_id_from_hf_home(tmp_path, llama_path, monkeypatch):
    home = tmp_path / "elsewhere"
    add_to_hf_cache(llama_path, home / "hub", "tiny-org/tiny-llama")
    monkeypatch.setenv("HF_HOME", str(home))
    snapshot = resolve_model_path("tiny-org/tiny-llama")
    assert snapshot == (home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT).resolve()
    assert read_model_config(snapshot).model_type == "llama"


def test_hf_hub_cache_wins_over_hf_home(tmp_path, llama_path, monkeypatch):
    # a bare name is a repo id too
    add_to_hf_cache(llama_path, tmp_path / "hub_cache", "tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    assert (resolve_model_path("tiny-llama") / "model.safetensors").is_file()


@pytest.mark.parametrize("revision", [COMMIT, "main"])
def test_revision(cache, revision):
    snapshot = resolve_model_path("tiny-org/tiny-llama", revision=revision, download_dir=cache)
    assert snapshot.name == COMMIT


@pytest.mark.parametrize("revision", ["v9", "f" * 40])
def test_unknown_revision_offline(cache, revision):
    with pytest.raises(ValueError) as info:
        resolve_model_path("tiny-org/tiny-llama", revision=revision, download_dir=cache)
    message = str(info.value)
    assert ("HF_HUB_OFFLINE is set" in message and "'tiny-org/tiny-llama'" in message
            and revision in message)
    assert f"not in the cache at {cache}" in message


def test_unknown_repo_offline(cache):
    with pytest.raises(ValueError, match=r"HF_HUB_OFFLINE is set and draft model 'tiny-org/nope' "
                       r"is not in the "):
        resolve_model_path("tiny-org/nope", download_dir=cache, what="draft model")


@pytest.mark.parametrize("skip, missing", [("model.safetensors", r"no \*\.safetensors"),
                                           ("config.json", "no config")])
def test_snapshot_must_be_a_safetensors_checkpoint(tmp_path, llama_path, skip, missing):
    add_to_hf_cache(llama_path, tmp_path / "cache", "tiny-org/bin-only", skip=(skip,))
    with pytest.raises(ValueError, match=f"'tiny-org/bin-only' has {missing}.*only safetensors "
                       f"checkpoints"):
        resolve_model_path("tiny-org/bin-only", download_dir=tmp_path / "cache")


def test_tokenizer_needs_no_weights(tmp_path, llama_path):
    add_to_hf_cache(llama_path, tmp_path / "cache", "tiny-org/tok", skip=("model.safetensors",))
    assert (resolve_model_path("tiny-org/tok", download_dir=tmp_path / "cache", what="tokenizer")
            / "config.json").is_file()


def test_download_request(tmp_path, monkeypatch):
    """What is asked of the Hub: only the files the engine reads, into the cache the environment
    names."""
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        (tmp_path / "snap").mkdir(exist_ok=True)
        (tmp_path / "snap" / "config.json").write_text("{}")
        (tmp_path / "snap" / "model.safetensors").write_bytes(b"")
        return str(tmp_path / "snap")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert resolve_model_path("org/m", revision="r") == tmp_path / "snap"
    kwargs = calls[-1]
    assert kwargs["revision"] == "r" and kwargs["local_files_only"] is False
    assert Path(kwargs["cache_dir"]) == tmp_path / "hf_home" / "hub"
    assert {"config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json"} <= set(
        kwargs["allow_patterns"])
    assert not any(p.endswith((".bin", ".pt", ".pth")) or p == "*"
                   for p in kwargs["allow_patterns"])

    resolve_model_path("org/m", what="tokenizer")
    assert "*.safetensors" not in calls[-1]["allow_patterns"]

    for value in ("1", "true", "YES", "On"):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        resolve_model_path("org/m", download_dir=tmp_path / "d")
        assert calls[-1]["local_files_only"] is True and calls[-1]["cache_dir"] == tmp_path / "d"


def _connection_error() -> Exception:
    """The connection error of the HTTP client this huggingface_hub version uses."""
    for module in ("httpx2", "httpx"):
        try:
            return __import__(module).ConnectError("connection refused")
        except ImportError:
            pass
    import requests

    return requests.ConnectionError("connection refused")


REF = r"model 'org/m' \(revision 'v2'\)"


@pytest.mark.parametrize("error, expected", [
    (_connection_error, f"^the Hugging Face Hub could not be reached and {REF} is not in the cache "
     f"at "),
    (lambda: LocalEntryNotFoundError("no cache"),
     f"^the Hugging Face Hub could not be reached and {REF} is not in"),
    (lambda: hub_error(GatedRepoError),
     f"^{REF} is gated on the Hugging Face Hub: request access .*HF_TOKEN"),
    (lambda: hub_error(RepositoryNotFoundError), f"^{REF} not found on the Hugging Face Hub"),
    (lambda: hub_error(RevisionNotFoundError),
     "^revision 'v2' not found in model 'org/m' on the Hugging Face Hub"),
])
def test_hub_errors_online(monkeypatch, error, expected):
    """Online, each failure of the Hub becomes a ValueError naming the id and revision."""
    def failing_snapshot_download(*args, **kwargs):
        raise error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match=expected):
        resolve_model_path("org/m", revision="v2")
