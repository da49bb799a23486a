"""bench/gpu_suite.sh --dry: the GPU suite's stages, imports and commands on CPU, as a GPU machine would run them
(a shim package for `fastpo`, PYTHONSAFEPATH=1, fastpo._C built by the suite, the trainer under torchrun with bf16
mixed precision), its fixed set of 7 result files, and the acceptance check of the GPU image: every stage passes with
tyro, docstring-parser and typeguard (and vllm, liger-kernel, flash-attn) hidden, the first three from the wheels that
`make gpu-carry` puts in .gpu-carry."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "gpu_suite.sh"
CARRY = ROOT / ".gpu-carry"
RESULT_FILES = {"summary.txt", "env.txt", "stages.csv", "results.csv", "suite.log", "tests.xml", "metrics.jsonl"}
STAGES = ["env", "build", "tests", "bench", "rollout", "train", "gap"]
#: What the GPU image lacks (docs/PLATFORM.md): hidden from the suite's processes by _HIDE below.
MISSING_ON_IMAGE = ("tyro", "docstring_parser", "typeguard", "vllm", "liger_kernel", "flash_attn")
#: Carried from the lock: distribution name -> the module the wheel provides.
CARRIED = {"tyro": "tyro", "docstring-parser": "docstring_parser", "typeguard": "typeguard",
           "typing-extensions": "typing_extensions"}

# A sitecustomize that makes the packages absent, as on the image: Python's path finder is wrapped so that a hidden
# top-level name is found only inside the allowed folders (the carried wheels); elsewhere it is "not found" (None,
# as for a package that is not installed: transformers' availability checks then say False instead of raising).
_HIDE = '''
import importlib.machinery, os, sys
HIDDEN = set(os.environ["SUITE_TEST_HIDDEN"].split(","))
ALLOWED = tuple(p for p in os.environ.get("SUITE_TEST_ALLOWED", "").split(os.pathsep) if p)
_Path = importlib.machinery.PathFinder


class _HidingPathFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        spec = _Path.find_spec(name, path, target)
        if spec is None or name.partition(".")[0] not in HIDDEN:
            return spec
        where = [spec.origin or "", *(spec.submodule_search_locations or [])]
        return spec if ALLOWED and any(str(w).startswith(ALLOWED) for w in where) else None

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return _Path.find_distributions(*args, **kwargs)

    @classmethod
    def invalidate_caches(cls):
        _Path.invalidate_caches()


sys.meta_path[:] = [_HidingPathFinder if f is _Path else f for f in sys.meta_path]
'''


def _env(extra_path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTPO_TEST_GPU", "OUT")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    if extra_path:
        env["PYTHONPATH"] = extra_path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _suite(*args: str, timeout: float, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUITE), *args], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


def _stages(outdir: Path) -> dict[str, dict]:
    return {row["stage"]: row for row in csv.DictReader((outdir / "stages.csv").open())}


def _results(outdir: Path) -> list[dict]:
    return list(csv.DictReader((outdir / "results.csv").open()))


def _carried_wheels() -> list[Path]:
    """The carried wheels, checked against the lock's pins; skips (outside CI) or fails (CI=true) without them."""
    wheels = sorted(CARRY.glob("*.whl"))
    if not wheels:
        reason = f"no wheels in {CARRY}: run `make gpu-carry` (make test does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    lock = (ROOT / "requirements" / "ci-cpu.txt").read_text().lower()
    for dist, module in CARRIED.items():
        pin = re.search(rf"^{dist}==(\S+)$", lock, re.MULTILINE)
        assert pin, f"{dist} has no pin in requirements/ci-cpu.txt"
        name = f"{module}-{pin.group(1)}-py3-none-any.whl"
        assert any(w.name.lower() == name for w in wheels), f"{name} not in {CARRY}: rerun `make gpu-carry`"
    return wheels


def test_usage_errors(tmp_path):
    out = _suite(timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "usage: bash bench/gpu_suite.sh [OUTDIR] [--dry] [--carry DIR]" in out.stderr
    out = _suite(str(tmp_path / "a"), "--fast", timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "unknown option --fast" in out.stderr
    out = _suite(str(tmp_path / "a"), "--stages", "env,smoke", timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "unknown stage smoke (stages: env build tests bench rollout train gap)" in out.stderr
    out = _suite(str(tmp_path / "a"), "--carry", str(tmp_path / "none"), timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "no such folder (make gpu-carry fills .gpu-carry)" in out.stderr


def _image_env(tmp_path: Path) -> dict[str, str]:
    """The suite's environment as on the GPU image: MISSING_ON_IMAGE hidden (importable only from the carry folder),
    after a probe that the hiding works."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE)
    env = _env(str(hide))
    env.update(SUITE_TEST_HIDDEN=",".join(MISSING_ON_IMAGE), SUITE_TEST_ALLOWED=str(CARRY))
    # the hiding works: without the carried wheels on the path, none of these imports
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; print([m for m in sys.argv[1:] "
                            "if u.find_spec(m) is not None])", *MISSING_ON_IMAGE], env=env, capture_output=True,
                           text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    return env


@pytest.mark.slow
def test_dry_run_passes_every_stage_from_the_carried_wheels_without_the_installed_packages(tmp_path):
    """Every stage through the shim, as the device command runs it: --carry with the image's missing packages
    hidden (one run covers both: each stage's CPU cost is paid once)."""
    wheels = _carried_wheels()
    image_env = _image_env(tmp_path)
    outdir = tmp_path / "out"
    # run from elsewhere with a relative OUTDIR: the suite must find the checkout and the interpreter itself
    proc = _suite("out", "--dry", "--carry", str(CARRY), timeout=1800, cwd=tmp_path, env=image_env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("stage budgets (s): env=") and lines[1].endswith("total=2160")  # 540 s x 4 on CPU
    assert {p.name for p in outdir.iterdir()} == RESULT_FILES

    stages = _stages(outdir)
    assert list(stages) == STAGES
    assert all(r["status"] == "ok" for r in stages.values()), stages
    assert all(None not in r for r in stages.values())  # no stray column (a comma in a note)
    assert stages["bench"]["note"] == "fused logprob at 64 and 128 tokens"
    assert stages["build"]["note"].endswith("(-O0: --dry)")  # the quick build: the dry run checks it builds
    assert all(int(r["seconds"]) <= int(r["budget_s"]) for r in stages.values())

    env = (outdir / "env.txt").read_text()
    assert env.index("torch ") < env.index("import fastpo ->")  # versions first
    shim = [line.split(" -> ")[1] for line in env.splitlines() if line.startswith("import fastpo.kernels ->")]
    assert shim and shim[0].endswith("/shim/fastpo/kernels/__init__.py") and not shim[0].startswith(str(ROOT))
    log = (outdir / "suite.log").read_text()
    assert [m.group(1) for m in re.finditer(r"^===== stage (\w+):", log, re.MULTILINE)] == STAGES
    assert re.search(r"^built .*/shim/fastpo/_C\.", log, re.MULTILINE)  # the build stage's _C, linked in the shim
    assert "--ignore=tests/kernels/test_gpu_compile.py" in log  # the static compile is CI's job, not the GPU's

    suite = ET.parse(outdir / "tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 10 and suite.get("failures") == "0" and suite.get("errors") == "0"

    rows = _results(outdir)
    fused = {(r["provider"], r["mode"], r["metric"], r["x_value"]) for r in rows if r["name"] == "fused_linear_logprob"}
    for n in ("64", "128"):
        assert {("cublas-gemm", "full", "time", n), ("fastpo", "full", "time", n), ("eager", "full", "time", n),
                ("compile", "full", "time", n), ("fastpo", "full", "pct_of_gemm", n),
                ("fastpo", "forward", "pct_of_spec_peak", n), ("eager", "full", "peak_memory", n)} <= fused
    # the rollout stage: bench_async's rows for both workloads, both drivers and their ratio; in fp32 on CPU the
    # bench itself refuses to write rows unless async sampled the very tokens lock-step did
    for name in ("rollout_qwen2-random-52M", "rollout_tiny-agent"):
        got = {(r["mode"], r["metric"]): float(r["p50"]) for r in rows if r["name"] == name}
        assert got[("async", "trajectories_equal_to_lockstep")] == 1.0, name
        assert got[("async/lockstep", "trajectories_per_s_ratio")] == pytest.approx(
            got[("async", "trajectories_per_s")] / got[("lockstep", "trajectories_per_s")]), name
        assert 0 < got[("async", "slot_occupancy")] <= 1 and 0 < got[("lockstep", "slot_occupancy")] <= 1, name
    its = {(r["mode"], r["metric"]): float(r["p50"]) for r in rows if r["name"] == "iterations_qwen2-random-52M"}
    for mode in ("partial-keep", "partial-keep-cut"):  # partial rollouts (KV kept, turns cut or not) vs sync
        assert its[(f"sync/{mode}", "iteration_time_ratio")] == pytest.approx(
            its[("sync", "iteration_s")] / its[(mode, "iteration_s")]), mode
        assert its[(mode, "staleness_max")] <= 1, mode
    summary_txt = (outdir / "summary.txt").read_text()
    assert "async/lockstep" in summary_txt and "iteration_time_ratio" in summary_txt
    train = {r["metric"]: float(r["p50"]) for r in rows if r["name"] == "train_validation"}
    assert set(train) == {"success_before", "success_after", "success_gain"}
    assert train["success_gain"] == pytest.approx(train["success_after"] - train["success_before"])
    gap = {r["mode"]: float(r["p50"]) for r in rows if r["name"] == "logprob_gap"}
    assert set(gap) == {"per-step", "first-step", "max"} and all(0 <= v < 1 for v in gap.values())

    metrics = [json.loads(line) for line in (outdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]  # validation before training, two steps, validation after
    assert "val-env/FrozenLake/success" in metrics[0] and "val-env/FrozenLake/success" in metrics[-1]
    for key in ("actor/grad_norm", "rollout/logprob_gap_mean"):
        assert math.isfinite(metrics[1][key]), key
    summary = (outdir / "summary.txt").read_text()
    assert "failed stages: none" in summary and "wall time:" in summary

    # the carried wheels answered for what the image lacks; the trainer's command line (tyro) ran from them
    for module in CARRIED.values():  # each from its wheel in the carry folder
        line = next(line for line in env.splitlines() if line.startswith(module + " "))
        assert f"{CARRY}/{module}-" in line and ".whl/" in line, line
    for module in ("vllm", "liger_kernel", "flash_attn"):
        assert re.search(rf"^{module} +absent$", env, re.MULTILINE), module
    assert len(wheels) == len(CARRIED)


@pytest.mark.slow
def test_a_failed_stage_returns_the_same_files(tmp_path):
    outdir = tmp_path / "out"
    proc = _suite(str(outdir), "--dry", "--stages", "env,gap", timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert {p.name for p in outdir.iterdir()} == RESULT_FILES
    stages = _stages(outdir)
    assert [(s, r["status"]) for s, r in stages.items()] == [
        ("env", "ok"), ("build", "skipped"), ("tests", "skipped"), ("bench", "skipped"), ("rollout", "skipped"),
        ("train", "skipped"), ("gap", "skipped")]
    assert stages["gap"]["note"] == "no train run metrics"
    assert "failed stages: gap" in (outdir / "summary.txt").read_text()
