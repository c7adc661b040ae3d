"""The C++ extension behind the CPU fast path: every source it lists, built together once a machine.

torch's cpp_extension compiles them at first use (10-25 s, `-O3 -march=native`) into minivllm's
cache (MINIVLLM_CACHE_DIR, by default ~/.cache/minivllm), never beside the sources: an install in a
read-only site-packages builds too. The module's name is a hash of the sources' and headers' bytes,
the CPU's flags and torch's version, so an edited source, another machine sharing the cache or a new
torch each get their own build, and two checkouts of the same sources share one. Two processes that
start at once do not both write it: cpp_extension holds a lock file in the build directory while
one compiles, and the other waits, then loads what it built. Each source registers
its ops under torch.ops.minivllm_cpu: the paged-attention kernel (attention/cpu_attention.py), the
fused layer ops (model/cpu_layer_ops.py), the tiled linear kernel (quantization/cpu_unquantized.py),
GGUF's block formats multiplied as stored (quantization/cpu_gguf.py), and a decode step's decoder
layer calling them all (model/cpu_decoder_layer.cpp, for model/cpu_bound_layer.py).
Only the cpu platform (platforms/cpu.py) builds it, once per process.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from minivllm import envs
from minivllm.platforms.cpu_hardware import cpu_flags

PACKAGE = Path(__file__).parent.parent
SOURCES = (PACKAGE / "attention/cpu_paged_attention.cpp", PACKAGE / "model/cpu_layer_ops.cpp",
           PACKAGE / "quantization/cpu_unquantized.cpp", PACKAGE / "quantization/cpu_gguf.cpp",
           PACKAGE / "model/cpu_decoder_layer.cpp")
# what they share: the vectorisable exp; each source's entry points (the decoder layer calls them)
HEADERS = (Path(__file__).parent / "cpu_vector_math.h", Path(__file__).parent / "cpu_ops.h")
# -fno-trapping-math: no code here reads floating-point exception flags, and under GCC's default
# (-ftrapping-math) a loop holding a comparison or a rounding that could raise one stays scalar:
# the softmax's exp ran one value at a time, a third of a batch-64 decode's attention. The values
# do not change (nothing reassociates); only loops that could not be vectorised now can be.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")


def _fingerprint() -> str:
    """A hash of what the built library depends on: the sources' and headers' bytes, the compiler
    flags, the CPU's flags (-march=native) and torch's version (its C++ ABI)."""
    import torch

    digest = hashlib.sha1()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update("\n".join([*CFLAGS, *sorted(cpu_flags()), torch.__version__]).encode())
    return digest.hexdigest()[:12]


def _build_directory(name: str) -> Path:
    """Where extension `name` is compiled and kept: one folder per fingerprint in the cache."""
    return Path(envs.MINIVLLM_CACHE_DIR).expanduser() / "cpu_extension" / name


def _built_library(name: str) -> Path:
    """The shared library of extension `name`, once built."""
    return _build_directory(name) / f"{name}.so"


def needs_compiling(name: str) -> bool:
    """Whether loading `name` will compile: its name changes with every input, so no library yet."""
    return not _built_library(name).exists()


def missing_toolchain() -> str | None:
    """What a first build lacks, said with how to install it, or None: a C++ compiler, Python's C
    headers. Found before compiling, because the compiler's own error is many lines of noise."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    if shutil.which(compiler) is None:
        return (f"no C++ compiler ({compiler!r} is not on PATH): install one (Debian/Ubuntu: "
                f"apt install g++; Fedora: dnf install gcc-c++; macOS: xcode-select --install) "
                f"or name it in CXX")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return ("no Python C headers (Python.h): install them (Debian/Ubuntu: apt install "
                "python3-dev; Fedora: dnf install python3-devel)")
    return None


def build() -> None:
    """Build the extension (or find it built) and load it, registering its ops; raises the build's
    error. A compile says so first, on stderr, and how long it took after: otherwise the first
    `LLM()` on a fresh clone sits silent for half a minute, which looks like a hang."""
    from torch.utils.cpp_extension import load

    name = f"minivllm_cpu_{_fingerprint()}"
    compiling = needs_compiling(name)
    if compiling:
        missing = missing_toolchain()
        if missing is not None:
            raise RuntimeError(missing)
        print(f"minivllm: compiling its C++ CPU kernels for this machine, once (typically 10-30 s, "
              f"more on a busy machine; later runs load them from {_build_directory(name)})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    directory = _build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(directory),
         extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
         is_python_module=False)
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
