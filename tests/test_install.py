"""The package as users install it: a wheel built from the repository, installed into a fresh venv outside it,
run from another directory with an empty build cache.

Everything the engine needs at run time must be in the wheel (the C++ sources the cpu platform compiles at
first use, the embedded models), the first build must write only into the cache (MINIVLLM_CACHE_DIR), never
beside the installed sources (a system site-packages is read-only), and the fast paths must come from that
build, not fall back to the readable torch code. The venv sees the machine's packages (torch, transformers,
fastapi...) through --system-site-packages, so nothing is downloaded; `minivllm.__file__` proves that the
copy imported is the installed one, not the repository's editable install. The build, the install and the
first run start beside the rest of the suite (tests/head_start.py); the checks run at the end.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from head_start import head_start_result

ROOT = Path(__file__).resolve().parent.parent
NATIVE_SOURCES = sorted(str(p.relative_to(ROOT)) for ext in ("*.cpp", "*.h") for p in (ROOT / "minivllm").rglob(ext))
MODEL_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "minivllm" / "data" / "models").glob("minivllm-tiny*/*"))
FALLBACK = "CPU C++ fast paths unavailable"  # platforms/cpu.py's one warning when the build failed

# run inside the venv, from a directory outside the repository: the embedded model, one exercise checker,
# and what the engine's platform chose for each op
SCRIPT = """
import json, sys, time
from importlib import metadata
import minivllm
from minivllm import LLM, SamplingParams
from minivllm.core.block_pool import BlockPool
from minivllm.exercises.ch03 import check_block_pool
from minivllm.platforms import cpu_extension
from minivllm.platforms.reference import ReferencePlatform

start = time.perf_counter()
llm = LLM()
first_llm_s = time.perf_counter() - start
out = llm.generate(["Hi, my name is"], SamplingParams(max_tokens=8))[0]
platform = llm.engine.runner.platform
report = check_block_pool(BlockPool, max_examples=2)
print(json.dumps({
    "file": minivllm.__file__, "version": minivllm.__version__, "dist_version": metadata.version("minivllm"),
    "text": out.outputs[0].text, "first_llm_s": first_llm_s, "platform": type(platform).__name__,
    "ops": platform.op_table(), "reference_ops": ReferencePlatform("cpu", platform.dtype).op_table(),
    "build_failure": cpu_extension.build_failure(), "missing": cpu_extension.missing_toolchain(),
    "checker": str(report), "checker_passed": report.passed}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(package: Path) -> set[str]:
    return {str(p.relative_to(package)) for p in package.rglob("*") if "__pycache__" not in p.parts}


def test_a_machine_without_a_compiler_hears_what_to_install_in_one_line(monkeypatch, tmp_path):
    """Found before compiling (the compiler's own failure is pages of noise): one line, naming the package."""
    from minivllm.platforms import cpu_extension

    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))  # an empty cache: this would compile
    monkeypatch.setattr(cpu_extension.shutil, "which", lambda name: None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: pytest.fail("compiled anyway"))
    reason = cpu_extension.build_failure.__wrapped__()
    assert "no C++ compiler" in reason and "apt install g++" in reason and "\n" not in reason


def head_start(tmp: Path) -> dict:
    """Runs beside the suite (tests/head_start.py): the wheel built, installed into a fresh venv, and the first
    `LLM()` run from an outside directory, which compiles the C++ kernels into an empty cache. Returns the
    venv's python, its environment, the outside directory, the wheel, the installed package, its files before
    that first run, and the run itself."""
    src = tmp / "src"  # a copy of what the build reads, so that building leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "minivllm", src / "minivllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("minivllm-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(MINIVLLM_CACHE_DIR=str(tmp / "cache"), HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    package = Path(subprocess.run([str(python), "-c", "import minivllm; print(minivllm.__file__)"], cwd=elsewhere,
                                  env=env, check=True, capture_output=True, text=True).stdout.strip()).parent
    before = _files(package)
    run = subprocess.run([str(python), "-c", SCRIPT], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=900)
    return dict(python=python, env=env, elsewhere=elsewhere, wheel=wheel, package=package, before=before, run=run)


@pytest.fixture(scope="module")
def installed(request) -> dict:
    return head_start_result(request)


def test_the_wheel_carries_the_native_sources_and_the_embedded_models(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert NATIVE_SOURCES and set(NATIVE_SOURCES) <= names, set(NATIVE_SOURCES) - names
    assert len(MODEL_FILES) >= 8 and set(MODEL_FILES) <= names, set(MODEL_FILES) - names
    from minivllm.platforms.cpu_extension import HEADERS, SOURCES  # every file the build reads is shipped

    assert {str(p.relative_to(ROOT)) for p in (*SOURCES, *HEADERS)} <= set(NATIVE_SOURCES)


def test_the_installed_wheel_runs_serves_and_grades_from_anywhere(installed):
    python, env, elsewhere, package, run = (installed[k] for k in ("python", "env", "elsewhere", "package", "run"))
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(python.parent.parent), got["file"]  # the installed copy
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert got["version"] == got["dist_version"] == version
    assert got["text"].strip(), "the embedded model generated nothing"
    assert got["checker_passed"], got["checker"]
    assert _files(package) == installed["before"], "the first build wrote beside the installed sources"
    if got["missing"] is not None:  # no compiler here: one line says what to install, and the engine still runs
        assert run.stderr.count(got["missing"]) == 1, run.stderr[-4000:]
        pytest.skip(f"no toolchain for the C++ fast paths: {got['missing']}")
    assert got["platform"] == "CpuPlatform" and got["build_failure"] is None, got["build_failure"]
    assert FALLBACK not in run.stderr
    fast = {op for op, impl in got["ops"].items() if impl != got["reference_ops"][op]}
    assert {"attention", "rms_norm"} <= fast, got["ops"]  # the C++ attention and layer ops, from the build
    assert any(p.suffix == ".so" for p in Path(env["MINIVLLM_CACHE_DIR"]).rglob("*")), "built outside the cache"
    print(f"first LLM() from the installed wheel, with an empty cache: {got['first_llm_s']:.0f} s")

    # `minivllm serve` (the console script the wheel installs), one request, then a clean stop
    port = _free_port()
    proc = subprocess.Popen(["minivllm", "serve", "--port", str(port), "--host", "127.0.0.1", "--log-level",
                             "warning"], cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the installed server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "minivllm-tiny", "prompt": "Hello", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=60)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0].decode()
    assert FALLBACK not in log and "compiling" not in log, log[-4000:]  # loaded the first run's build
    version = subprocess.run(["minivllm", "--version"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert version.stdout.strip() == f"minivllm {got['version']}", version.stderr[-2000:]
