"""bench/gpu_suite.sh --dry: the GPU suite's stages, imports and commands on CPU, as a GPU machine would run them
(a shim package for `fastpo`, PYTHONSAFEPATH=1, the trainer under torchrun with bf16 mixed precision)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench" / "gpu_suite.sh"


def _suite(*args: str, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTPO_TEST_GPU", "OUT")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SUITE), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_usage_errors(tmp_path):
    out = _suite(timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "usage: bash bench/gpu_suite.sh [OUTDIR] [--dry]" in out.stderr
    out = _suite(str(tmp_path / "a"), "--fast", timeout=30, cwd=tmp_path)
    assert out.returncode == 2 and "unknown option --fast" in out.stderr


@pytest.mark.slow
def test_dry_run_passes_every_stage_through_the_shim(tmp_path):
    outdir = tmp_path / "out"
    # run from elsewhere with a relative OUTDIR: the suite must find the checkout and the interpreter itself
    proc = _suite("out", "--dry", timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("stage budgets (s): env=") and lines[1].endswith("total=1920")  # 480 s x 4 on CPU

    stages = {row["stage"]: row for row in csv.DictReader((outdir / "stages.csv").open())}
    assert list(stages) == ["env", "tests", "bench", "smoke", "sync"]
    for name in ("env", "tests", "bench", "smoke"):
        assert stages[name]["status"] == "ok", stages[name]
    assert stages["sync"]["status"] in ("ok", "skipped")
    assert all(int(r["seconds"]) <= int(r["budget_s"]) for r in stages.values())

    env = (outdir / "env.txt").read_text()
    assert env.index("torch ") < env.index("import fastpo ->")  # versions first
    shim = [line.split(" -> ")[1] for line in env.splitlines() if line.startswith("import fastpo.kernels ->")]
    assert shim and shim[0].endswith("/shim/fastpo/kernels/__init__.py") and not shim[0].startswith(str(ROOT))

    suite = ET.parse(outdir / "tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 10 and suite.get("failures") == "0" and suite.get("errors") == "0"

    kernels = list(csv.DictReader((outdir / "kernels.csv").open()))
    assert {r["name"] for r in kernels} >= {"fused_linear_logprob", "ppo_loss", "gae", "grpo"}

    metrics = [json.loads(line) for line in (outdir / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    for key in ("actor/grad_norm", "critic/grad_norm", "critic/vf_loss"):  # GAE: the critic trained too
        assert math.isfinite(metrics[0][key]), key
    assert "wall time:" in (outdir / "summary.txt").read_text()
