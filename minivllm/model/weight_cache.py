"""One copy of the weights for several processes: a loaded model written to one file, then mapped.

Data parallelism runs N engines over the same model; each loading the checkpoint would hold N
private copies. Instead the first process loads the model as usual (its kernels' layouts included:
the CPU's tiles, int8 rows and scales) and writes every tensor it holds, exactly as held, into one
file. Then every process builds the model on the "meta" device and points each tensor at a slice of
that file mapped privately (`torch.from_file(shared=False)`: the page cache's pages until written,
and nothing writes weights). The kernel keeps the bytes once, and a later start skips loading.

The file: an 8-byte length, a JSON header (identity, and per tensor its module, kind, dtype, shape,
offset), then the tensors' bytes, 64-byte aligned. Not safetensors: its Python API copies each
tensor out of the mapping, and cannot say "a non-persistent buffer" or "an attribute layout set".
Its name hashes everything it depends on (`cache_key`), so a cache from another checkpoint, dtype or
platform is never read; a lock makes concurrent starters wait for the first writer. Nothing deletes
old files (delete MINIVLLM_WEIGHT_CACHE_DIR). A layout without plain bytes (oneDNN's opaque mkldnn
tensors, GPU memory) is not mapped: each process then loads its own copy, and says so in the log.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm import envs
from minivllm.logger import init_logger

if TYPE_CHECKING:
    from minivllm.model.llama import Implementations
    from minivllm.model.loader import ModelConfig

logger = init_logger(__name__)

FORMAT = 1  # bump when what a layout step writes changes: old files are then never read
ALIGN = 64  # every tensor's offset: a cache line, and a multiple of every dtype's size
SCALARS = (bool, int, float, str, type(None))
EMBEDDING = "model.embed_tokens.weight"


class NotMappable(Exception):
    """The loaded model holds a tensor with no plain bytes (an mkldnn or GPU tensor)."""


def cache_key(path: Path, cfg: ModelConfig, impl: Implementations, dtype: torch.dtype,
              device: str) -> dict:
    """Everything a cached file depends on: change any of it and another file is used."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    quant = cfg.quantization
    quant_id = None if quant is None else {
        "class": type(quant).__qualname__,
        **{f.name: repr(getattr(quant, f.name)) for f in fields(quant) if f.compare}}
    return {"format": FORMAT, "torch": torch.__version__, "device": device, "dtype": str(dtype),
            "checkpoint": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
            "model": str(path.resolve()), "quantization": quant_id,
            "kernels": {name: type(k).__qualname__ for name, k in impl.linear._asdict().items()},
            "ops": {name: getattr(op, "__qualname__", type(op).__qualname__)
                    for name, op in impl.ops._asdict().items()},
            "attention": type(impl.attention).__qualname__,
            "gguf_activations": envs.MINIVLLM_CPU_GGUF_ACTIVATIONS}  # packed rows or not


def cache_file(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{digest}.weights"


def load_cached(cache_dir: Path, key: dict, build_meta: Callable[[], nn.Module],
                load: Callable[[], nn.Module]) -> nn.Module | None:
    """The model with its tensors mapped from the cache, which `load()` (the ordinary loader) fills
    first if no process has yet; where the model cannot be mapped, the model `load()` built, private
    to this process. `build_meta()`: the same model on the meta device."""
    file = cache_file(Path(cache_dir).expanduser(), key)
    file.parent.mkdir(parents=True, exist_ok=True)
    with _locked(file.with_suffix(".lock")):
        if not file.exists():
            model = load()
            try:
                write(model, build_meta(), key, file)
            except NotMappable as why:
                logger.info("weight cache: %s; every process loads its own copy", why)
                return model
            del model  # from here, this process maps the file like every other
    return mapped(file, key, build_meta())


@contextlib.contextmanager
def _locked(lock: Path):
    """Hold an exclusive lock on `lock` (created if absent): one writer, the others wait."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


# ---- writing ------------------------------------------------------------------------------------
def module_state(model: nn.Module, meta: nn.Module) -> tuple[list[tuple[str, str, str, object]],
                                                             dict, dict]:
    """What the loaded `model` holds beyond a freshly built `meta` one: its tensors as (module,
    kind, name, tensor) with kind "param", "buffer", "buffer_np" (not persistent) or "attr" (a plain
    tensor attribute, or a repeat of a tensor listed before: "alias" with the first's place), the
    scalar attributes that loading changed, and those it deleted."""
    tensors, scalars, deleted, seen = [], {}, {}, {}
    meta_modules = dict(meta.named_modules())
    for mname, module in model.named_modules():
        base = meta_modules[mname]
        items = [("param", n, t) for n, t in module._parameters.items() if t is not None]
        items += [("buffer" if n not in module._non_persistent_buffers_set else "buffer_np", n, t)
                  for n, t in module._buffers.items() if t is not None]
        items += [("attr", n, t) for n, t in vars(module).items()
                  if isinstance(t, torch.Tensor) and not n.startswith("_")]
        for kind, name, tensor in items:
            if mname and f"{mname}.{name}" == EMBEDDING and getattr(module, "lookup", None):
                continue  # a tied head lent its layout to the embedding: _retie redoes that
            first = seen.setdefault(id(tensor), (mname, name))
            tensors.append((mname, kind, name, tensor if first == (mname, name) else first))
        changed = {n: v for n, v in vars(module).items() if isinstance(v, SCALARS)
                   and not n.startswith("_") and (n not in vars(base) or vars(base)[n] != v)}
        held = {*vars(module), *module._parameters, *module._buffers}
        gone = [n for n in [*vars(base), *base._parameters, *base._buffers]
                if not n.startswith("_") and n not in held]
        if changed:
            scalars[mname] = changed
        if gone:
            deleted[mname] = gone
    return tensors, scalars, deleted


def write(model: nn.Module, meta: nn.Module, key: dict, file: Path) -> None:
    """Write `model`'s tensors and the attributes loading set into `file` (atomically: a reader
    never sees half a file)."""
    tensors, scalars, deleted = module_state(model, meta)
    entries, offset = [], 0
    for mname, kind, name, tensor in tensors:
        if isinstance(tensor, tuple):
            entries.append({"module": mname, "kind": kind, "name": name, "alias": list(tensor)})
            continue
        if tensor.is_mkldnn or tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise NotMappable(f"{mname}.{name} is a {tensor.layout} tensor on {tensor.device} "
                              f"(mkldnn: {tensor.is_mkldnn}), with no plain bytes to map")
        offset = -(-offset // ALIGN) * ALIGN
        size = tensor.numel() * tensor.element_size()
        entries.append({"module": mname, "kind": kind, "name": name, "offset": offset,
                        "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "nbytes": size})
        offset += size
    header = json.dumps({"key": key, "tensors": entries, "scalars": scalars,
                         "deleted": deleted}).encode()
    start = _data_start(len(header))
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for entry, (_, _, _, tensor) in zip(entries, tensors):
            if "offset" in entry:
                f.seek(start + entry["offset"])
                f.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(start + offset)
    os.replace(tmp, file)
    logger.info("weight cache: wrote %s (%.1f MiB)", file, offset / 2**20)


# ---- mapping ------------------------------------------------------------------------------------
def _data_start(header_length: int) -> int:
    return -(-(8 + header_length) // 4096) * 4096  # the data begins on a page


def mapped(file: Path, key: dict, model: nn.Module) -> nn.Module:
    """`model` (built on the meta device) with every tensor a view of `file`, mapped privately."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header, start = json.loads(f.read(length)), _data_start(length)
    if header["key"] != key:  # a hash collision, or a file edited by hand
        raise ValueError(f"weight cache {file} was written for another model: delete it")
    size = file.stat().st_size
    data = torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)
    modules = dict(model.named_modules())
    placed: dict[tuple[str, str], torch.Tensor] = {}
    for e in header["tensors"]:
        module = modules[e["module"]]
        if "alias" in e:
            tensor = placed[tuple(e["alias"])]
        else:
            dtype = getattr(torch, e["dtype"])
            raw = data[start + e["offset"]: start + e["offset"] + e["nbytes"]]
            tensor = raw.view(dtype).view(e["shape"])
            if e["kind"] == "param":
                tensor = nn.Parameter(tensor, requires_grad=False)
        placed[(e["module"], e["name"])] = tensor
        _set(module, e["kind"], e["name"], tensor)
    for mname, names in header["deleted"].items():
        for name in names:
            delattr(modules[mname], name)
    for mname, values in header["scalars"].items():
        for name, value in values.items():
            setattr(modules[mname], name, value)
    leftover = [f"{m}.{n}" for m, module in modules.items()
                for n, t in [*module._parameters.items(), *module._buffers.items()]
                if t is not None and t.is_meta and f"{m}.{n}" != EMBEDDING]
    if leftover:
        raise ValueError(f"weight cache {file} lacks {', '.join(leftover[:5])}: delete it")
    _retie(model)
    logger.info("weight cache: mapped %s (%.1f MiB)", file, (size - start) / 2**20)
    return model.eval()


def _set(module: nn.Module, kind: str, name: str, tensor: torch.Tensor) -> None:
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    if kind == "param":
        module._parameters[name] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(
            tensor, requires_grad=False)
    elif kind == "attr":
        setattr(module, name, tensor)
    else:
        module.register_buffer(name, tensor, persistent=kind == "buffer")


def _retie(model: nn.Module) -> None:
    """Tied embeddings stay tied: a head whose layout is the plain table holds the embedding's own
    tensor; one in another layout lends it to the embedding (LlamaForCausalLM.share_tied_weight)."""
    head, embedding = model.lm_head, model.model.embed_tokens
    if not head.tied:
        return
    if embedding.weight.is_meta and head.weight.shape == embedding.weight.shape:
        embedding.weight = head.weight
    elif embedding.weight.is_meta:
        embedding.read_rows_from(head.weight, functools.partial(head.quant_method.rows, head))
