"""Compile every Triton kernel variant the engine can launch, ahead of time, for GPUs that need not be here.

    python bench/kernel_report.py                  # table: registers, spills, shared memory, occupancy
    python bench/kernel_report.py --json           # one record per variant (tests/test_aot_compile.py)
    python bench/kernel_report.py --write-results  # also replace the table's section in bench/RESULTS.md

Triton's whole pipeline down to PTX and a cubin runs on CPU, with the ptxas bundled in the triton wheel, so
a variant that spills or asks for more shared memory than a T4 has is caught on any machine. The variants
come from the launchers' own choice functions (`decode_launch_config` and friends) applied to the model
shapes below, and each kernel's non-constexpr arguments are specialised by Triton's own rule (16-divisible
ints and pointers get an alignment hint, ints equal to 1 become constants), as its JIT would on a GPU.

Run without TRITON_INTERPRET: under the interpreter the kernels are not JIT functions and cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- kernel_report: begin -->", "<!-- kernel_report: end -->"


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one compute capability (CUDA C Programming Guide, compute capabilities table)."""

    sm: int
    gpu: str
    num_sms: int  # of that GPU: decides the split-K counts the CUDA graphs fix
    max_warps: int  # resident warps per SM (max threads / 32)
    max_blocks: int  # resident blocks per SM
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes, the opt-in maximum a kernel may ask for
    smem_reserved: int  # bytes the driver reserves per resident block
    dtypes: tuple[str, ...]  # the cache dtypes the engine can run on it


# fp32: `dtype="float32"` is accepted on CUDA (the launchers switch tl.dot to exact "ieee" for it, and
# bench/gpu_throughput.py's CUDA-graph check runs an fp32 model), so fp32 variants are compiled everywhere.
# bf16 needs sm >= 80; EngineConfig.resolve_dtype falls back to fp16 on a T4.
ARCHES = {
    75: Arch(75, "T4", 40, 32, 16, 64 << 10, 64 << 10, 0, ("float16", "float32")),
    80: Arch(80, "A100", 108, 64, 32, 164 << 10, 163 << 10, 1 << 10, ("float16", "bfloat16", "float32")),
    90: Arch(90, "H100", 132, 64, 32, 228 << 10, 227 << 10, 1 << 10, ("float16", "bfloat16", "float32")),
}
REGISTERS_PER_SM, REGISTER_UNIT = 64 << 10, 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    qk_norm: bool = False


# Shapes the engine's families take: head dims 32, 64, 128 and an odd one (24: padded to 32 and not
# 16-divisible, so its loads get no alignment hint), GQA groups 2, 4 and 7 (not a power of two), the
# embedded default model, and Qwen3's per-head q/k norms. Compile time is the budget (about 0.6 s per
# variant): more shapes of the same classes would add compiles, not new code.
MODELS = (
    Model("minivllm-tiny", 4, 2, 32, 128, 384),
    Model("qwen3-test", 4, 2, 24, 64, 136, qk_norm=True),
    Model("qwen2.5-0.5b", 14, 2, 64, 896, 4864),
    Model("llama-3-8b", 32, 8, 128, 4096, 14336),
)
BLOCK_SIZES = (8, 16, 32)  # KV cache block sizes crossed with the default model; the others use 16
DEFAULT_BLOCK_SIZE = 16
# The norm, rotary and SwiGLU kernels' constexprs only pad sizes to powers of two: the smallest, odd shape
# and the largest one bracket the rest.
ELEMENTWISE_MODELS = ("qwen3-test", "llama-3-8b")
QUERY_LENS = (1, 2048)  # prefill max_query_len: the launcher's shortest and tallest tiles
KV_FORMATS = (0, 1, 2)  # the kernels' KV_FP8: the model's dtype, fp8 e4m3, fp8 e5m2 (minivllm/kernels/fp8.py)
MAX_MODEL_LEN = 32768  # long enough that choose_num_splits is capped only by the grid, as in CUDA graphs


@dataclass(frozen=True)
class Variant:
    """One compile: a kernel, a target, and what its JIT would see (types, hints, constants, options)."""

    kernel: str  # "module:function"
    arch: int
    dtype: str
    signature: tuple  # ((name, type), ...), "constexpr" for constants
    constants: tuple  # ((name, value), ...)
    hinted: tuple  # names of the arguments with a 16-divisibility hint
    num_warps: int
    num_stages: int

    def label(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constants if k.isupper())
        return f"{self.kernel.split(':')[1].strip('_')}[{consts}, warps={self.num_warps}, stages={self.num_stages}]"


def _variant(kernel, arch: int, dtype: str, args: dict, config: dict) -> Variant:
    """Specialise the runtime arguments by Triton's own rule; pointers are typed strings, assumed aligned."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    config = dict(config)
    options = {k: config.pop(k) for k in ("num_warps", "num_stages") if k in config}
    signature, constants, hinted = [], dict(config), []
    for name in kernel.arg_names:
        if name in config:
            signature.append((name, "constexpr"))
            continue
        value = args[name]
        if isinstance(value, str):  # a pointer: torch allocations (and the engine's views) are 16-byte aligned
            kind, spec = value, "D"
        else:
            kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature.append((name, kind))
        if kind == "constexpr":
            constants[name] = spec
        elif spec == "D":
            hinted.append(name)
    return Variant(f"{kernel.fn.__module__}:{kernel.fn.__name__}", arch, dtype, tuple(signature),
                   tuple(sorted(constants.items())), tuple(hinted), options.get("num_warps", 4),
                   options.get("num_stages", 3))


def _ptr(dtype: str) -> str:
    return "*" + {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]


def attention_variants(model: Model, arch: Arch, dtype: str, block_size: int, kv_fp8: int) -> list[Variant]:
    """The store, decode (and split-K reduce) and prefill launches over one cache layout: `kv_fp8` is the
    kernels' KV_FP8 (0: the model's dtype; 1, 2: fp8 e4m3 / e5m2, passed as bytes)."""
    import importlib

    from minivllm.kernels import paged_decode, paged_prefill
    from minivllm.runner.cuda_graphs import capture_sizes

    store_kv = importlib.import_module("minivllm.kernels.store_kv")  # the package exports the function of that name

    torch_dtype, p = getattr(torch, dtype), _ptr(dtype)
    c = p if kv_fp8 == 0 else "*u8"
    h, kv, d, group = model.heads, model.kv_heads, model.head_dim, model.heads // model.kv_heads
    qkv = (h + 2 * kv) * d  # q, k, v are views of the fused projection's rows
    cache = dict(stride_cb=block_size * kv * d, stride_cs=kv * d, stride_ch=d, stride_bt=MAX_MODEL_LEN // block_size,
                 head_dim=d)
    out = []
    out.append(_variant(store_kv._store_kv_kernel, arch.sm, dtype, dict(
        key_ptr=p, value_ptr=p, k_cache_ptr=c, v_cache_ptr=c, slot_mapping_ptr="*i64", k_scale=0.5, v_scale=0.5,
        stride_kt=qkv, stride_kh=d, stride_vt=qkv, stride_vh=d, num_kv_heads=kv, **cache),
        store_kv.store_kv_config(kv, d, block_size, kv_fp8)))
    # decode: split-K off, and the largest count the CUDA graphs fix on this GPU. Other counts > 1 change
    # one constant divisor in the kernel and a smaller BLOCK_S in the reduce: no new register or shared-memory
    # pressure, so they are left out to keep the compile count down.
    chosen = {paged_decode.choose_num_splits(size, kv, MAX_MODEL_LEN, arch.num_sms) for size in capture_sizes(256)}
    for num_splits in sorted({1, max(chosen)}) if block_size == DEFAULT_BLOCK_SIZE else (1,):
        out.append(_variant(paged_decode._paged_decode_kernel, arch.sm, dtype, dict(
            q_ptr=p, k_cache_ptr=c, v_cache_ptr=c, block_tables_ptr="*i32", seq_lens_ptr="*i32", out_ptr=p,
            part_acc_ptr="*fp32" if num_splits > 1 else p, part_m_ptr="*fp32" if num_splits > 1 else p,
            part_l_ptr="*fp32" if num_splits > 1 else p, scale=d**-0.5, k_dequant=1.0, v_dequant=1.0,
            stride_qb=h * d, stride_qh=d, stride_ob=h * d, stride_oh=d, window=-1, **cache),
            paged_decode.decode_launch_config(d, group, block_size, num_splits, torch_dtype, arch.sm,
                                              kv_fp8=kv_fp8)))
        if num_splits > 1:
            out.append(_variant(paged_decode._split_reduce_kernel, arch.sm, dtype, dict(
                part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr=p, stride_ob=h * d,
                stride_oh=d, num_heads=h, head_dim=d), paged_decode.split_reduce_config(d, num_splits)))
    for max_query_len in QUERY_LENS if block_size == DEFAULT_BLOCK_SIZE else QUERY_LENS[-1:]:
        out.append(_variant(paged_prefill._paged_prefill_kernel, arch.sm, dtype, dict(
            q_ptr=p, k_cache_ptr=c, v_cache_ptr=c, block_tables_ptr="*i32", query_start_loc_ptr="*i32",
            seq_lens_ptr="*i32", out_ptr=p, scale=d**-0.5, k_dequant=1.0, v_dequant=1.0, stride_qt=h * d,
            stride_qh=d, stride_ot=h * d, stride_oh=d, window=-1, **cache),
            paged_prefill.prefill_launch_config(d, group, block_size, max_query_len, torch_dtype, arch.sm,
                                                kv_fp8=kv_fp8)))
    return out


def model_variants(model: Model, arch: Arch, dtype: str, block_size: int) -> list[Variant]:
    """Every launch the engine makes for one model on one target: the same arguments the launchers pass."""
    from minivllm.kernels import activation, fused_moe, gguf_linear, int4_linear, int8_linear, norm, rotary

    torch_dtype, p = getattr(torch, dtype), _ptr(dtype)
    h, kv, d = model.heads, model.kv_heads, model.head_dim
    qkv = (h + 2 * kv) * d  # q, k, v are views of the fused projection's rows
    out = []
    # the cache in the model's dtype, and (issue 24) as fp8 bytes in either format, converted in the kernels;
    # fp8 at the default block size only: the block size changes address arithmetic, not the conversions
    for kv_fp8 in KV_FORMATS if block_size == DEFAULT_BLOCK_SIZE else KV_FORMATS[:1]:
        out += attention_variants(model, arch, dtype, block_size, kv_fp8)
    if block_size != DEFAULT_BLOCK_SIZE or model.name not in ELEMENTWISE_MODELS:
        return out  # the rest does not depend on the cache layout, nor on the attention shape
    norms = [(model.hidden, 1, model.hidden, residual) for residual in (False, True)]
    if model.qk_norm:  # each head of q (a view of the fused projection) and of k
        norms += [(d, h, qkv, False), (d, kv, qkv, False)]
    for dim, rows, stride_t, residual in norms:
        out.append(_variant(norm._rms_norm_kernel, arch.sm, dtype, dict(
            x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, residual_out_ptr=p, stride_xt=stride_t,
            stride_xh=dim, stride_rt=dim if residual else 0, stride_ot=rows * dim, stride_oh=dim,
            num_heads=rows, dim=dim, eps=1e-6), norm.rms_norm_config(dim, residual)))
    out.append(_variant(rotary._rotary_kernel, arch.sm, dtype, dict(
        q_ptr=p, k_ptr=p, q_out_ptr=p, k_out_ptr=p, positions_ptr="*i64", cos_sin_ptr="*fp32",
        stride_qt=qkv, stride_qh=d, stride_kt=qkv, stride_kh=d, stride_oqt=h * d, stride_oqh=d,
        stride_okt=kv * d, stride_okh=d, num_q_heads=h, num_k_heads=kv, half=d // 2),
        rotary.rotary_config(h, kv, d)))
    out.append(_variant(activation._silu_and_mul_kernel, arch.sm, dtype, dict(
        gate_up_ptr=p, out_ptr=p, stride_gt=2 * model.intermediate, stride_ot=model.intermediate,
        intermediate=model.intermediate), activation.silu_and_mul_config(model.intermediate)))
    # quantized linears (issue 24): a decode and a prefill batch, with and without bias (Qwen2's q/k/v);
    # 4-bit with the groups checkpoints use (32, 128). One shape: only divisibility hints depend on it
    n, k = model.hidden, model.intermediate
    for num_tokens in QUERY_LENS if model.name == ELEMENTWISE_MODELS[-1] else ():
        for bias in (False, True):
            config = int8_linear.int8_linear_config(num_tokens, torch_dtype, arch.sm)
            out.append(_variant(int8_linear._int8_linear_kernel, arch.sm, dtype, dict(
                x_ptr=p, w_ptr="*i8", scale_ptr=p, bias_ptr=p, out_ptr=p, M=num_tokens, N=n, K=k, stride_xm=k,
                stride_wn=k, stride_om=n), dict(HAS_BIAS=bias, **config)))
            for group in (32, 128):
                out.append(_variant(int4_linear._int4_linear_kernel, arch.sm, dtype, dict(
                    x_ptr=p, qweight_ptr="*i32", zeros_ptr="*u8", scales_ptr=p, bias_ptr=p, out_ptr=p, M=num_tokens,
                    N=n, K=k, stride_xm=k, stride_qk=n, stride_zg=n, stride_sg=n, stride_om=n),
                    dict(HAS_BIAS=bias, **int4_linear.int4_linear_config(num_tokens, group, torch_dtype, arch.sm))))
        # a GGUF file's blocks (issue 37): each type, no bias (Llama-family files have none)
        for ggml_type, block_bytes in gguf_linear.BLOCK_BYTES.items():
            out.append(_variant(gguf_linear._gguf_linear_kernel, arch.sm, dtype, dict(
                x_ptr=p, w_ptr="*u8", bias_ptr=p, out_ptr=p, M=num_tokens, N=n, K=k, stride_xm=k,
                stride_wn=k // gguf_linear.BLOCK_WEIGHTS[ggml_type] * block_bytes, stride_om=n),
                dict(HAS_BIAS=False, **gguf_linear.gguf_linear_config(num_tokens, ggml_type, torch_dtype, arch.sm))))
    # MoE experts (issue 39): both grouped GEMMs at every row-tile height, an MLP's shape for an expert's
    # float experts, and int8 ones (the weights read as bytes, one scale per output row of each expert)
    for rows in (1, 32, 64) if model.name == ELEMENTWISE_MODELS[-1] else ():
        for gather, weighted, kk, nn in ((True, False, n, 2 * k), (False, True, k, n)):
            for scaled in (False, True):
                out.append(_variant(fused_moe._grouped_gemm_kernel, arch.sm, dtype, dict(
                    a_ptr=p, row_index_ptr="*i64", w_ptr="*i8" if scaled else p, scale_ptr=p,
                    row_weight_ptr="*fp32", out_ptr=p, tile_expert_ptr="*i64", tile_start_ptr="*i64",
                    offsets_ptr="*i64", N=nn, K=kk, stride_am=kk, stride_we=nn * kk, stride_wn=kk,
                    stride_se=nn, stride_om=nn), dict(GATHER=gather, WEIGHTED=weighted, SCALED=scaled,
                                                      **fused_moe.fused_moe_config(rows, torch_dtype, arch.sm,
                                                                                  scaled))))
    return out


def all_variants(arches=tuple(ARCHES)) -> list[Variant]:
    """Deduplicated: different shapes often lead a launcher to the same compile."""
    found: dict[Variant, None] = {}
    for sm in arches:
        for dtype in ARCHES[sm].dtypes:
            for model in MODELS:
                for block_size in BLOCK_SIZES if model is MODELS[0] else (DEFAULT_BLOCK_SIZE,):
                    found.update(dict.fromkeys(model_variants(model, ARCHES[sm], dtype, block_size)))
    return list(found)


def ptxas_path(sm: int) -> str | None:
    """The ptxas shipped in the triton wheel (None when this triton has no NVIDIA backend)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(sm).path
    except Exception:  # noqa: BLE001 - any failure here means: cannot compile for NVIDIA on this machine
        return None
    return path if path and os.path.exists(path) else None


def compile_variant(variant: Variant) -> dict:
    """Compile to a cubin, then ask ptxas (as Triton calls it) for registers and spills: a loaded kernel
    reports n_regs / n_spills, but nothing can be loaded without the GPU."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource

    module, name = variant.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    index = {n: i for i, n in enumerate(kernel.arg_names)}
    record = dict(asdict(variant), label=variant.label(), error=None)
    try:
        src = ASTSource(kernel, dict(variant.signature), {(index[k],): v for k, v in variant.constants},
                        {(index[k],): [["tt.divisibility", 16]] for k in variant.hinted})
        compiled = triton.compile(src, target=GPUTarget("cuda", variant.arch, 32),
                                  options=dict(num_warps=variant.num_warps, num_stages=variant.num_stages))
    except Exception as exc:  # noqa: BLE001 - reported per variant; the test fails on it
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return record
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        fmad = [] if compiled.metadata.enable_fp_fusion else ["--fmad=false"]
        log = subprocess.run([ptxas_path(variant.arch), "-v", *fmad, "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(variant.arch)}", str(ptx), "-o",
                              str(ptx.with_suffix(".o"))], capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    static_smem = re.search(r"(\d+) bytes smem", log)
    record.update(registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                  spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                  shared=compiled.metadata.shared + (int(static_smem.group(1)) if static_smem else 0))
    record.update(occupancy(ARCHES[variant.arch], record["registers"], record["shared"], variant.num_warps))
    return record


def occupancy(arch: Arch, registers: int, shared: int, num_warps: int) -> dict:
    """Resident blocks and warps per SM, and which resource runs out first."""
    regs_per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    limits = {"warps": arch.max_warps // num_warps, "blocks": arch.max_blocks,
              "registers": REGISTERS_PER_SM // regs_per_warp // num_warps}
    if shared:
        limits["shared"] = arch.smem_per_sm // (shared + arch.smem_reserved)
    blocks = min(limits.values())
    return dict(shared_limit=arch.smem_per_block, blocks_per_sm=blocks, warps_per_sm=blocks * num_warps,
                occupancy=blocks * num_warps / arch.max_warps, limiter=min(limits, key=limits.get))


def compile_all(variants: list[Variant], workers: int) -> list[dict]:
    """Compiles run in worker processes: each variant is independent and mostly single-threaded."""
    if workers <= 1:
        return [compile_variant(v) for v in variants]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_variant, variants, chunksize=4))


def kernel_name(record: dict) -> str:
    return record["kernel"].split(":")[1].strip("_").removesuffix("_kernel")


def _span(values: list, fmt) -> str:
    low, high = min(values), max(values)
    return fmt(low) if low == high else f"{fmt(low)}–{fmt(high)}"


def table(records: list[dict]) -> str:
    """One row per kernel and target: ranges over its variants (dtypes, shapes, constexprs)."""
    groups = defaultdict(list)
    for r in records:
        groups[kernel_name(r), r["arch"]].append(r)
    lines = ["| kernel | target | variants | registers | spills (bytes) | shared memory | warps / SM | occupancy "
             "| worst variant (limited by) |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, sm), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if r["error"] is None]
        if not ok:
            lines.append(f"| {name} | sm_{sm} | {len(rs)} | compile error | | | | | |")
            continue
        worst = min(ok, key=lambda r: (r["occupancy"], -r["registers"]))
        span = lambda key, fmt=str, ok=ok: _span([r[key] for r in ok], fmt)
        errors = len(rs) - len(ok)
        lines.append(
            f"| {name} | sm_{sm} {ARCHES[sm].gpu} | {len(rs)}{f' ({errors} failed)' if errors else ''} "
            f"| {span('registers')} | {max(r['spill_stores'] for r in ok)} "
            f"| {span('shared', lambda b: f'{b / 1024:.1f} KiB')} | {span('warps_per_sm')} "
            f"| {span('occupancy', lambda o: f'{o:.0%}')} | {worst['dtype']} {worst['label']} ({worst['limiter']}) |")
    return "\n".join(lines)


def problems(records: list[dict]) -> list[str]:
    """What the test fails on: compile errors, spills, shared memory above the per-block limit."""
    out = []
    for r in records:
        where = f"sm_{r['arch']} {r['dtype']} {r['label']}"
        if r["error"]:
            out.append(f"{where}: {r['error']}")
        elif r["spill_stores"] or r["spill_loads"]:
            out.append(f"{where}: spills {r['spill_stores']} bytes stored, {r['spill_loads']} loaded")
        elif r["shared"] > r["shared_limit"]:
            out.append(f"{where}: {r['shared']} bytes of shared memory, limit {r['shared_limit']}")
    return out


def write_results(text: str, path: Path = RESULTS) -> None:
    """Replace the delimited section of RESULTS.md (append it the first time)."""
    section = f"{BEGIN}\n{text}\n{END}"
    doc = path.read_text()
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + section + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(doc)


def section(records: list[dict], seconds: float) -> str:
    import triton

    counts = ", ".join(f"sm_{sm} {sum(r['arch'] == sm for r in records)}" for sm in ARCHES)
    issues = problems(records)
    return "\n".join([
        "## Kernels compiled ahead of time (`python bench/kernel_report.py --write-results`)", "",
        f"Every kernel variant the launchers choose, compiled on CPU by triton {triton.__version__} and its "
        f"bundled ptxas for T4 (sm_75), A100 (sm_80) and H100 (sm_90): {len(records)} compiles ({counts}) in "
        f"{seconds:.0f} s on 2 cores (less when Triton's on-disk cache holds them; about 60 s cold on an idle 2-core "
        "machine). Model shapes: " + ", ".join(m.name for m in MODELS) + "; dtypes fp16 "
        "everywhere, bf16 from sm_80, fp32 (opt-in on GPU) everywhere; KV caches in the model's dtype and, for the "
        "store, decode and prefill kernels at block size 16, in fp8 e4m3 and e5m2 (`kv_cache_dtype`). Occupancy: "
        "resident warps per SM over "
        "the maximum (32 on sm_75, 64 on sm_80/sm_90), from registers (64K per SM), shared memory (64/164/228 "
        "KiB per SM, 1 KiB reserved per block from sm_80), max blocks and threads per SM. Ranges are min–max "
        "over a row's variants; the worst variant is the one with the lowest occupancy.", "",
        table(records), "",
        "No variant spills or exceeds its shared-memory limit." if not issues else
        "Problems:\n\n" + "\n".join(f"* {p}" for p in issues),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON record per variant instead of a table")
    parser.add_argument("--write-results", action="store_true", help="replace the table's section in RESULTS.md")
    parser.add_argument("--arch", type=int, nargs="*", default=list(ARCHES), choices=list(ARCHES))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    missing = [sm for sm in args.arch if ptxas_path(sm) is None]
    if missing:
        sys.exit(f"no ptxas for sm_{missing[0]}: this triton cannot compile for NVIDIA GPUs here")
    start = time.perf_counter()
    records = compile_all(all_variants(tuple(args.arch)), args.workers)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(records))
        return
    text = section(records, seconds)
    print(text)
    if args.write_results:
        write_results(text)


if __name__ == "__main__":
    main()
