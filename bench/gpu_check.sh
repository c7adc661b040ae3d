#!/usr/bin/env bash
# Everything that needs a GPU, in one command on a fresh GPU machine (`make gpu-check` runs this):
#   1. install what is missing (`make install`: the package and dev extras; the machine's own torch is kept)
#   2. the Triton kernels against the torch reference in fp16 and bf16, and their timings (bench/gpu_kernels.py)
#   3. the CUDA-graph and cpu_offload_gb tests, with Triton compiling for the GPU, not interpreting
#   4. a short end-to-end throughput run, whose CUDA-graph check compares with transformers (bench/gpu_throughput.py)
#   5. every chapter under nbval on the GPU in the dtype "auto" picks there (bf16 from sm 8.0, else fp16)
# `bash bench/gpu_check.sh t4` (`make gpu-check-t4`), a second call: every chapter with fp16 forced
# (MINIVLLM_CUDA_DTYPE=float16), as on Colab's T4. The first H200 run (session 14) took 31 s for step 2, 38 s
# for step 3, over 100 s for step 4 and about 1.4 s a chapter cell (240 cells: about 6 minutes) for step 5:
# so each pass of the chapters has a call of its own. Each step has a time limit (the first call's add to
# 570 s, inside one 10-minute device call; session 15's run took 541 s); a failed step does not stop
# the others. Everything goes to one
# results file (GPU_CHECK_RESULTS, default bench/gpu_check_results.md, not committed): per step its
# command, exit status, seconds and the tail of its output; each step's whole output goes beside it
# (<results>-<step number>.log). Exit status: 0 when every step passed. Copy the figures that matter into
# bench/RESULTS.md by hand.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
RESULTS=${GPU_CHECK_RESULTS:-bench/gpu_check_results.md}
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET MINIVLLM_CPU_DTYPE MINIVLLM_CUDA_DTYPE  # the GPU's own defaults, compiled kernels

if ! "$PYTHON" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "gpu-check: no CUDA GPU visible to $PYTHON (torch.cuda.is_available() is False); nothing to do" >&2
    exit 2
fi

failed=0
steps=0
{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    "$PYTHON" - <<'EOF'
import platform, torch
p = torch.cuda.get_device_properties(0)
print(f"{torch.cuda.get_device_name(0)}, sm {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}")
EOF
    echo
} > "$RESULTS"

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, append its outcome to the results file
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    local log t0 rc
    log=$(mktemp)
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - t0 ))
    [ $rc -eq 124 ] && echo "(stopped after its ${limit}-second limit)" >> "$log"
    [ $rc -ne 0 ] && failed=1
    {
        echo "## $name: $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)"), ${secs} s"
        echo
        echo '```'
        echo "\$ $*"
        grep -q " PASSED" "$log" && echo "items passed: $(grep -c ' PASSED' "$log")"
        grep -E "^FAILED|^ERROR" "$log" | head -n 20
        tail -n 30 "$log"
        echo '```'
        echo
    } >> "$RESULTS"
    tail -n 3 "$log" >&2
    steps=$((steps + 1))
    mv "$log" "${RESULTS%.md}-$steps.log"
}

if ! "$PYTHON" -c "import minivllm, nbval, triton, transformers" 2>/dev/null; then
    step "install (make install)" 300 make install PYTHON="$PYTHON"
fi
if [ "${1:-}" = t4 ]; then
    step "chapters on the GPU, fp16 forced (as a T4)" 560 env MINIVLLM_CUDA_DTYPE=float16 "$PYTHON" -m pytest \
        chapters/ --nbval-lax --nbval-current-env -v -p no:cacheprovider
else
    step "kernel checks in fp16 and bf16, and timings" 45 "$PYTHON" bench/gpu_kernels.py
    # TRITON_INTERPRET=0: tests/conftest.py interprets Triton unless told otherwise
    step "CUDA-graph and cpu_offload_gb tests" 75 env TRITON_INTERPRET=0 "$PYTHON" -m pytest \
        tests/test_cuda_graphs.py tests/test_weight_offload.py -q -p no:cacheprovider
    # outputs of at most 256 tokens: transformers' static batches of 64 ran past 150 s with 1,024 (session 15)
    step "end-to-end throughput, short" 120 "$PYTHON" bench/gpu_throughput.py --models qwen3-0.6b \
        --requests 64 --max-len 256 --no-eager
    # the last chapters first: in session 15 the time limit cut chapter 14 off
    # shellcheck disable=SC2046
    step "chapters on the GPU, dtype auto" 330 "$PYTHON" -m pytest $(ls -r chapters/*.ipynb) --nbval-lax \
        --nbval-current-env -v -p no:cacheprovider
fi

echo "results: $RESULTS" >&2
exit $failed
