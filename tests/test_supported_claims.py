"""What the chapters and the README say is supported agrees with what the engine does.

A chapter once listed quantized weights, `.gguf` files and tensor parallelism as "Not supported" while
chapters 12 and 13 taught them. Every "Supported: ..." and "Not supported: ..." sentence in the chapters
and the README is read here, and each feature it names is looked up in the engine: its registries (the
loader's model families, what `quantization=` accepts, which vLLM arguments `EngineArgs` accepts only at
their harmless value) or its refusals (raised here). A sentence that denies what the engine does, or
claims what it refuses, fails; so does a supported model family missing from the lists.
"""

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.model.loader import SUPPORTED, checkpoint_tensors, read_model_config
from minivllm.quantization import ACCEPTED

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py")), ROOT / "README.md"]
CLAIM = re.compile(r"(?<![A-Za-z])(Not supported|Supported):(.*?)(?:\.\s|\.$)", re.S)


def vllm_argument_refused(name: str) -> bool:
    """True where EngineArgs takes the argument only at a value that asks for nothing (so refuses it)."""
    field = {f.name: f for f in fields(EngineArgs)}[name]
    return "accepts" in field.metadata


def bin_checkpoint_refused(tmp_path: Path) -> bool:
    """The loader's own answer for a directory holding only a pickled `.bin` checkpoint."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    cfg = read_model_config(ROOT / "minivllm" / "data" / "models" / "minivllm-tiny")
    try:
        next(checkpoint_tensors(tmp_path, cfg))
    except ValueError:
        return True
    return False


# feature: (what names it in prose, whether the engine supports it)
def features(tmp_path: Path) -> dict[str, tuple[re.Pattern, bool]]:
    return {
        "quantized weights": (re.compile(r"quantiz|GPTQ|AWQ|int8", re.I),
                              {"int8", "gptq", "awq"} <= set(ACCEPTED.values())),
        "GGUF files": (re.compile(r"gguf", re.I), "gguf" in ACCEPTED.values()),
        "tensor parallelism": (re.compile(r"tensor[ -]parallel", re.I),
                               not vllm_argument_refused("tensor_parallel_size")),
        "pipeline parallelism": (re.compile(r"pipeline[ -]parallel", re.I),
                                 not vllm_argument_refused("pipeline_parallel_size")),
        "data parallelism": (re.compile(r"data[ -]parallel", re.I),
                             not vllm_argument_refused("data_parallel_size")),
        ".bin checkpoints": (re.compile(r"\.bin\b"), not bin_checkpoint_refused(tmp_path)),
    }


def claims() -> list[tuple[str, bool, str]]:
    """(file, says supported, sentence) for every Supported/Not supported sentence."""
    out = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            text = re.sub(r"^# ?", "", text, flags=re.M)
        for match in CLAIM.finditer(text):
            out.append((path.name, match.group(1) == "Supported", " ".join(match.group(2).split())))
    return out


def test_the_claims_are_found():
    """The scan itself works: chapter 10's list is printed from the engine, the README still has both."""
    found = {(name, positive) for name, positive, _ in claims()}
    assert {("README.md", True), ("README.md", False)} <= found


@pytest.mark.parametrize("name,positive,sentence", claims())
def test_a_claim_agrees_with_the_engine(name, positive, sentence, tmp_path):
    for feature, (pattern, supported) in features(tmp_path).items():
        if pattern.search(sentence):
            assert supported == positive, (
                f"{name} says {feature} {'are' if positive else 'are not'} supported, but the engine "
                f"{'does' if supported else 'does not'} support them: {sentence!r}")


def test_every_supported_family_is_listed():
    """Each model_type the loader accepts is named in a Supported sentence."""
    listed = " ".join(sentence for _, positive, sentence in claims() if positive).lower()
    missing = [family for family in SUPPORTED if family not in listed]
    assert not missing, f"the loader supports {missing}, which no Supported list names"
