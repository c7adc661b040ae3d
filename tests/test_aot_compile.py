"""Every Triton kernel variant the engine can launch compiles for T4 (sm_75), A100 (sm_80) and H100 (sm_90),
without spilling registers and within the target's shared memory per block: checked on CPU, no GPU needed.

The variants come from the launchers' own choice functions (bench/kernel_report.py enumerates them), so a
new constexpr or launch option is compiled as soon as a launcher can pick it. conftest.py sets
TRITON_INTERPRET=1, under which kernels cannot be compiled, so the compiles run in one subprocess without
it (both cores, Triton's on-disk cache shared with the engine), started beside the suite (tests/head_start.py),
and each target's test reads its JSON.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from head_start import head_start_result

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "bench" / "kernel_report.py"
ARCHES = (75, 80, 90)
SHARED_PER_BLOCK = {75: 64 << 10, 80: 163 << 10, 90: 227 << 10}  # opt-in maxima, CUDA programming guide


def _toolchain_missing() -> str | None:
    """Why the compiles cannot run here, or None: they need triton's NVIDIA backend and its bundled ptxas."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(80).path
    except Exception as exc:  # noqa: BLE001 - whatever the reason, this machine cannot compile for NVIDIA
        return f"triton's NVIDIA backend is not available ({type(exc).__name__}: {exc})"
    return None if path and os.path.exists(path) else f"triton's bundled ptxas is missing ({path})"


def head_start(folder: Path) -> list[dict] | str:
    """Runs beside the suite (tests/head_start.py): every variant's record, or why none can be compiled here."""
    reason = _toolchain_missing()
    if reason:
        return reason
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's minivllm
    run = subprocess.run([sys.executable, str(REPORT), "--json"], capture_output=True, text=True, env=env,
                         timeout=1800, cwd=ROOT)  # about 730 compiles: over 10 min on 2 busy cores
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def records(request) -> list[dict]:
    got = head_start_result(request)
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.mark.parametrize("arch", ARCHES)
def test_every_variant_compiles_without_spills(records, arch):
    mine = [r for r in records if r["arch"] == arch]
    assert mine, f"no variants for sm_{arch}"
    kernels = {r["kernel"].split(":")[1] for r in mine}
    assert kernels == {"_store_kv_kernel", "_paged_decode_kernel", "_split_reduce_kernel", "_paged_prefill_kernel",
                       "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_int8_linear_kernel",
                       "_int4_linear_kernel", "_gguf_linear_kernel", "_grouped_gemm_kernel"}
    bad = []
    for r in mine:
        where = f"sm_{arch} {r['dtype']} {r['label']}"
        if r["error"]:
            bad.append(f"{where}: {r['error']}")
        elif r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{where}: {r['registers']} registers, spills {r['spill_stores']} B / {r['spill_loads']} B")
        elif r["shared"] > SHARED_PER_BLOCK[arch]:
            bad.append(f"{where}: {r['shared']} B shared memory > {SHARED_PER_BLOCK[arch]} B per block")
    assert not bad, "\n".join(bad)


def test_dtypes_per_target(records):
    """fp16 and fp32 everywhere, bf16 only where the GPU has it (the engine falls back to fp16 on a T4)."""
    dtypes = {arch: {r["dtype"] for r in records if r["arch"] == arch} for arch in ARCHES}
    assert dtypes == {75: {"float16", "float32"}, 80: {"float16", "bfloat16", "float32"},
                      90: {"float16", "bfloat16", "float32"}}


def test_variants_follow_the_launchers():
    """The report's decode and prefill variants are what the launchers' config functions return."""
    import torch

    from minivllm.kernels.paged_decode import decode_launch_config
    from minivllm.kernels.paged_prefill import prefill_launch_config

    t4 = decode_launch_config(128, 4, 16, 1, torch.float16, arch=75)
    h100 = decode_launch_config(128, 4, 16, 1, torch.bfloat16, arch=90)
    assert t4["BLOCK_N"] == 32 and h100["BLOCK_N"] == 64  # a 64-position tile spills on sm_75
    assert decode_launch_config(128, 4, 16, 1, torch.float16)["BLOCK_N"] == 64  # off CUDA: as before
    assert prefill_launch_config(80, 1, 16, 2048, torch.float32, arch=75)["BLOCK_D"] == 128
