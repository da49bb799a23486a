"""bench/bench_kernels.py end to end at its --quick sizes: every CPU section runs at HEAD's API and writes its rows
(a section that no longer imports would otherwise only show when the full ~10-minute benchmark is rerun)."""

import csv
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_quick_cpu_sections_write_their_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py"])
    import bench_kernels

    bench_kernels.main(["--quick", "--results-dir", str(tmp_path), "--allow-dirty"])
    rows = list(csv.DictReader((tmp_path / "kernels.csv").open()))
    names = {r["name"] for r in rows}
    assert {"fused_linear_logprob", "gae", "grpo", "ppo_loss", "gigpo_estimator"} <= names, names
    gigpo = {r["provider"]: float(r["p50"]) for r in rows if r["name"] == "gigpo_estimator" and r["metric"] == "time"}
    assert set(gigpo) == {"grpo", "gigpo"} and all(v > 0 for v in gigpo.values())
