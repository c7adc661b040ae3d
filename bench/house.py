"""The house in numbers: lines per room, what the chapters read, the scheduler's imports, and the
files and types one request crosses from `LLM.generate` to its `RequestOutput`.

    python bench/house.py            # every figure
    python bench/house.py --lines    # only the line counts (no model is run)

Lines are every line of minivllm's Python, C++ and header files (blank lines and docstrings
included: a reader scrolls past them too). Each file belongs to the first room whose pattern
matches it (ROOMS below). The request path is traced with sys.setprofile over one
`LLM.generate` call on the embedded model: every minivllm file with a Python function that ran,
and every minivllm class one of whose methods ran.
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minivllm"
SOURCES = ("*.py", "*.cpp", "*.h")

# (room, patterns relative to minivllm/): the first room that matches a file owns it
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("core (plain Python)", ("core/*",)),
    ("reference model and attention", (
        "model/__init__.py", "model/llama.py", "model/layer_ops.py", "model/rotary.py",
        "model/linear.py", "model/embedding.py", "model/loader.py", "model/weights.py",
        "model/lazy_loading.py", "model/registry.py", "attention/__init__.py",
        "attention/backend.py", "attention/metadata.py", "attention/online_softmax.py",
        "attention/torch_backend.py")),
    # the families beyond the Llama reference, one file each, and mixtures of experts (chapter 14):
    # what a chapter reads to follow one request through the dense engine is counted without them
    ("model families and mixture of experts", (
        "model/mistral.py", "model/qwen2.py", "model/qwen3.py", "model/gemma*.py", "model/moe.py",
        "model/moe_layer.py", "model/mixtral.py", "model/qwen2_moe.py", "model/qwen3_moe.py")),
    # CUDA graphs are the cuda platform's fast path beside the runner's eager forward (issue 34:
    # "cuda (Triton kernels + CUDA graphs)"), so they count there
    ("runner", ("runner/__init__.py", "runner/model_runner.py", "runner/step_batch.py",
                "runner/memory.py", "runner/logprobs.py", "runner/sequence_state.py",
                "runner/weight_offload.py")),
    ("engine loop", (
        "engine/__init__.py", "engine/llm_engine.py", "engine/step_driver.py",
        "engine/input_processor.py", "engine/output_processor.py", "engine/trace.py",
        "engine/stats.py")),
    ("sampler", ("sampling/__init__.py", "sampling/sampler.py", "sampling/rejection_sampler.py")),
    ("speculative decoding", ("spec_decode/*",)),
    ("platform: interface and reference", (
        "platforms/__init__.py", "platforms/interface.py", "platforms/reference.py")),
    ("platform: cpu fast paths", (
        "platforms/cpu*", "model/cpu_*", "model/compiled.py", "attention/cpu_*",
        "quantization/cpu_*")),
    ("platform: cuda fast paths", ("platforms/cuda.py", "kernels/*", "attention/triton_*",
                                   "runner/cuda_graphs.py")),
    ("quantization", ("quantization/*", "model/gguf_blocks.py")),
    ("distributed and executor", ("distributed/*", "executor/*", "engine/data_parallel.py",
                                  "model/weight_cache.py", "model/moe_parallel.py")),
    ("engine extras (beam search, metrics, journey)", ("engine/*",)),
    ("logits processors, structured output", (
        "sampling/*", "structured_output.py")),
    ("plain data and settings", (
        "sampling_params.py", "outputs.py", "inputs.py", "hooks.py", "keyword_args.py", "envs.py",
        "logger.py", "tokenizer.py", "config.py", "__init__.py")),
    ("vLLM's surface (LLM, EngineArgs, CLI, import paths)", (
        "entrypoints/*", "v1/*", "utils/*", "__main__.py", "hub.py", "engine/arg_utils.py")),
    ("server", ("server/*",)),
    ("widgets", ("widgets/*",)),
    ("exercises", ("exercises/*",)),
]
# what the chapters read line by line to follow a request through the dense engine (the budget:
# 5,000 lines); the families beyond Llama and mixtures of experts are counted in their own room
CHAPTER_READ = ("core (plain Python)", "reference model and attention", "runner", "engine loop",
                "sampler", "speculative decoding")


def source_files() -> list[Path]:
    return sorted(p for pattern in SOURCES for p in PACKAGE.rglob(pattern)
                  if "__pycache__" not in p.parts)


def room_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE).as_posix()
    for room, patterns in ROOMS:
        if any(fnmatch.fnmatch(relative, pattern) for pattern in patterns):
            return room
    raise ValueError(f"{relative} belongs to no room: add it to ROOMS in bench/house.py")


def lines_per_room() -> Counter:
    counts: Counter = Counter()
    for path in source_files():
        counts[room_of(path)] += len(path.read_text().splitlines())
    return counts


def scheduler_imports() -> str:
    """Import the scheduler in a fresh interpreter: is torch loaded, how many minivllm modules."""
    code = ("import sys, time; t = time.perf_counter(); import minivllm.core.scheduler; "
            "ms = (time.perf_counter() - t) * 1000; "
            "n = sum(m.startswith('minivllm') for m in sys.modules); "
            "print(f'torch loaded: {\"torch\" in sys.modules}, minivllm modules: {n}, {ms:.0f} ms')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=PACKAGE.parent).stdout.strip()


def request_path() -> tuple[list[str], list[str]]:
    """The minivllm files and classes one LLM.generate call runs through (one prompt)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(enforce_eager=True)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
    files: set[str] = set()
    classes: set[str] = set()

    def profile(frame, event, arg) -> None:
        filename = frame.f_code.co_filename
        if event != "call" or str(PACKAGE) not in filename:
            return
        files.add(Path(filename).relative_to(PACKAGE).as_posix())
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith("minivllm"):
            classes.add(type(owner).__name__)

    sys.setprofile(profile)
    try:
        llm.generate(["Hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        sys.setprofile(None)
    return sorted(files), sorted(classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", action="store_true", help="only the line counts")
    args = parser.parse_args()
    counts = lines_per_room()
    width = max(len(room) for room, _ in ROOMS)
    for room, _ in ROOMS:
        print(f"{room:<{width}}  {counts[room]:6,d}")
    read = sum(counts[room] for room in CHAPTER_READ)
    print(f"{'total':<{width}}  {sum(counts.values()):6,d}")
    print(f"{'what the chapters read':<{width}}  {read:6,d}  ({', '.join(CHAPTER_READ)})")
    if args.lines:
        return
    print(f"\nimport minivllm.core.scheduler: {scheduler_imports()}")
    files, classes = request_path()
    print(f"\none LLM.generate call runs through {len(files)} files and {len(classes)} classes:")
    print("  files:  ", ", ".join(files))
    print("  classes:", ", ".join(classes))


if __name__ == "__main__":
    main()
