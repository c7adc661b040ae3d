"""The weight cache (minivllm/model/weight_cache.py): a loaded model written once, then mapped."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minivllm.model import load_model, read_model_config
from minivllm.model.llama import READABLE
from minivllm.model.weight_cache import cache_file, cache_key
from minivllm.platforms import choose_platform
from minivllm.quantization import resolve_quantization
from minivllm.quantization.cpu_unquantized import ONEDNN

ROOT = Path(__file__).resolve().parent.parent


def _load(path, cache_dir, dtype=torch.float32, quantization=None, impl=None):
    cfg = read_model_config(path)
    cfg = replace(cfg, quantization=resolve_quantization(quantization, None, False, str(path)))
    impl = impl or choose_platform("cpu", dtype).implementations
    return load_model(path, cfg, impl, dtype, "cpu", weight_cache=cache_dir), cfg, impl


def _logits(model, cfg):
    """The next-token logits of a fixed prompt through the model's own embedding and LM head."""
    ids = torch.tensor([3, 17, 42, 5, 99])
    with torch.inference_mode():
        x = model.model.embed_tokens(ids)
        return model.compute_logits(model.model.norm(x)[0])


def _mapped_file(model) -> str | None:
    """The file behind the model's first parameter, if it is a mapping (per /proc/self/maps)."""
    address = next(model.parameters()).data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[-1] if len(rest) >= 5 else None
    return None


@pytest.mark.parametrize("kind,dtype,quantization", [
    ("llama", torch.float32, None), ("qwen2", torch.float32, None),  # qwen2's tiny checkpoint is tied
    ("llama", torch.bfloat16, None), ("llama", torch.float32, "int8")])
def test_cache_written_once_then_mapped_with_equal_results(checkpoints, tmp_path, kind, dtype, quantization):
    path = checkpoints[kind][0]
    plain, cfg, impl = _load(path, None, dtype, quantization)
    cached, _, _ = _load(path, tmp_path, dtype, quantization)
    files = list(tmp_path.glob("*.weights"))
    assert len(files) == 1 and _mapped_file(cached) == str(files[0])
    mtime = files[0].stat().st_mtime_ns
    again, _, _ = _load(path, tmp_path, dtype, quantization)  # a second start maps it, unwritten
    assert files[0].stat().st_mtime_ns == mtime and list(tmp_path.glob("*.weights")) == files
    for model in (cached, again):
        assert torch.equal(_logits(model, cfg), _logits(plain, cfg))
        assert not any(p.is_meta for p in model.parameters())
    if cfg.tie_word_embeddings:  # still one tensor for both
        head, emb = again.lm_head, again.model.embed_tokens
        assert head.tied and emb.weight.data_ptr() == head.weight.data_ptr()


def test_cache_keyed_by_checkpoint_dtype_and_platform(checkpoints, tmp_path):
    llama, qwen = checkpoints["llama"][0], checkpoints["qwen2"][0]
    cfg = read_model_config(llama)
    cpu = choose_platform("cpu", torch.float32).implementations
    base = cache_key(llama, cfg, cpu, torch.float32, "cpu")
    others = [cache_key(qwen, read_model_config(qwen), cpu, torch.float32, "cpu"),
              cache_key(llama, cfg, cpu, torch.bfloat16, "cpu")]
    others.append(cache_key(llama, cfg, READABLE, torch.float32, "cpu"))  # another platform's kernels
    names = {cache_file(tmp_path, k) for k in others}
    assert cache_file(tmp_path, base) not in names and len(names) == len(others)
    assert cache_file(tmp_path, base) == cache_file(tmp_path, cache_key(llama, cfg, cpu, torch.float32, "cpu"))


def test_touched_checkpoint_is_not_reused(checkpoints, tmp_path):
    """A checkpoint file rewritten (another mtime) gets a new cache file, never the stale one."""
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"][0], path)
    _load(path, tmp_path / "cache")
    weights = next(path.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    _load(path, tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.weights"))) == 2


def test_two_processes_share_the_mapped_pages(llama_path, tmp_path):
    """Concurrent starters: one writes, the other waits for it; both map the same file."""
    code = ("import sys, torch; from tests.test_weight_cache import _load, _mapped_file; "
            "m, _, _ = _load(sys.argv[1], sys.argv[2]); print(_mapped_file(m))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(llama_path), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    files = list(tmp_path.glob("*.weights"))
    assert len(files) == 1 and outs == [str(files[0])] * 2



def test_onednn_layout_is_not_mapped_but_loads(llama_path, tmp_path):
    """oneDNN's blocked weights (no AVX-512) are opaque mkldnn tensors: nothing to map. Each process
    then loads its own copy, and no file is left behind."""
    cpu = choose_platform("cpu", torch.float32).implementations
    impl = cpu._replace(linear=cpu.linear._replace(float=ONEDNN))
    plain, cfg, _ = _load(llama_path, None, impl=impl)
    model, _, _ = _load(llama_path, tmp_path, impl=impl)
    assert model.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert not list(tmp_path.glob("*.weights")) and not (_mapped_file(model) or "").endswith(".weights")
    assert torch.equal(_logits(model, cfg), _logits(plain, cfg))
