"""The C++ extension behind the CPU fast path: every source it lists built together, once per machine.

torch's cpp_extension compiles them at first use (10-25 s, `-O3 -march=native`) into its extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) and rebuilds when a source changes. The module's
name carries a hash of the CPU's flags, so a cache shared by different machines never hands one another's build.
Each source registers its ops under torch.ops.minivllm_cpu: the small-batch linear kernel (model/small_linear.py).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

SOURCES = (
    Path(__file__).parent / "model" / "cpu_small_linear.cpp",
)


def _cpu_fingerprint() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


@functools.cache  # one build (or one failure) per process: a failure is not retried by every caller
def _build() -> Exception | None:
    try:
        from torch.utils.cpp_extension import load

        load(name=f"minivllm_cpu_{_cpu_fingerprint()}", sources=[str(s) for s in SOURCES],
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as err:  # noqa: BLE001 -- no compiler, no headers, a failed build: callers fall back
        return err
    return None


def build() -> None:
    """Build (or find in the cache) and load the extension, registering its ops; raises the build's error."""
    error = _build()
    if error is not None:
        raise error
