"""The C++ extension behind the CPU fast path: every source it lists, built together once a machine.

torch's cpp_extension compiles them at first use (10-25 s, `-O3 -march=native`) into its extension
cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and rebuilds when a source
changes. The module's name carries a hash of the CPU's flags and the sources' paths, so a cache
shared by different machines (or checkouts) never hands one another's build. Each source registers
its ops under torch.ops.minivllm_cpu: the paged-attention kernel (attention/cpu_attention.py), the
fused layer ops (model/cpu_layer_ops.py), the tiled linear kernel (quantization/cpu_unquantized.py),
GGUF's block formats multiplied as stored (quantization/cpu_gguf.py).
Only the cpu platform (platforms/cpu.py) builds it, once per process.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path

from minivllm.platforms.cpu_hardware import cpu_flags

PACKAGE = Path(__file__).parent.parent
SOURCES = (PACKAGE / "attention/cpu_paged_attention.cpp", PACKAGE / "model/cpu_layer_ops.cpp",
           PACKAGE / "quantization/cpu_unquantized.cpp", PACKAGE / "quantization/cpu_gguf.cpp")
HEADERS = (Path(__file__).parent / "cpu_vector_math.h",)  # what they share (the vectorisable exp)


def _fingerprint() -> str:
    """A hash of the CPU's flags and of where the sources are: two checkouts never share (and
    rebuild) one build."""
    text = "\n".join([*sorted(cpu_flags()), *map(str, SOURCES)])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _built_library(name: str) -> Path:
    """Where torch's cpp_extension puts the shared library of extension `name`."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def needs_compiling(name: str) -> bool:
    """Whether loading `name` will compile: no library yet, or a source or header newer than it."""
    library = _built_library(name)
    newest = max(path.stat().st_mtime for path in (*SOURCES, *HEADERS))
    return not library.exists() or newest > library.stat().st_mtime


def build() -> None:
    """Build the extension (or find it built) and load it, registering its ops; raises the build's
    error. A compile says so first, on stderr, and how long it took after: otherwise the first
    `LLM()` on a fresh clone sits silent for half a minute, which looks like a hang."""
    from torch.utils.cpp_extension import load

    name = f"minivllm_cpu_{_fingerprint()}"
    compiling = needs_compiling(name)
    if compiling:
        print(f"minivllm: compiling its C++ CPU kernels for this machine, once (typically 10-30 s, "
              f"more on a busy machine; later runs load them from "
              f"{_built_library(name).parent.parent})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    # torch rebuilds when a source or a build flag changes, not a header: the headers' hash rides
    # along as a flag
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:10]
    load(name=name, sources=[str(s) for s in SOURCES],
         extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DMINIVLLM_CPU_HEADERS={headers}"],
         extra_ldflags=["-fopenmp"], is_python_module=False)
    if compiling:
        print(f"minivllm: C++ CPU kernels compiled in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)


@functools.cache  # one build (or one failure) per process
def build_failure() -> str | None:
    """`build()` (a build takes seconds, a cached one ~10 ms, a loaded one under 1 ms). None once
    the ops are registered, else why not in one line (no compiler, no headers, a failed build): what
    the cpu platform's warning says before it keeps the readable torch path."""
    try:
        build()
    except Exception as err:  # noqa: BLE001  (every failure means the same to callers: fall back)
        text = str(err).strip()
        return text.splitlines()[-1] if text else type(err).__name__
    return None


def build_ahead() -> None:
    """What `make install` runs: build now rather than at the first `LLM()`, and say which path
    the engine will take. Never fails: a machine without a compiler runs the readable torch code,
    and this says why."""
    reason = build_failure()
    print("minivllm: C++ CPU kernels ready" if reason is None else
          f"minivllm: C++ CPU kernels not built ({reason}); on CPUs the engine will run the "
          f"readable torch code")
