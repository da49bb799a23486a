"""bench/bench_kernels.py end to end at its --quick sizes: every CPU section runs at HEAD's API and writes its rows
(a section that no longer imports would otherwise only show when the full ~10-minute benchmark is rerun)."""

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

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


def test_gpu_fused_rows_on_cpu_with_the_gemm_reference_and_an_out_of_memory_provider(monkeypatch):
    """The suite's bench stage (--gpu --only fused), its code path on CPU tensors: every provider gets time,
    % of the same-shape GEMMs, % of spec peak and peak memory rows; a provider that runs out of memory gets one NaN
    row saying so and the others still run."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kernels

    def oom(x, weight, ids):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    providers = {"fastpo": bench_kernels.naive_logprob, "oom": oom}
    timer = bench_kernels._timer(dry=True)
    rows = bench_kernels._gpu_fused(32, providers, 16, 64, torch.float32, "cpu", timer)
    got = {(r["provider"], r["mode"], r["metric"]) for r in rows}
    assert {("cublas-gemm", "forward", "time"), ("cublas-gemm", "full", "time")} <= got
    for mode in ("forward", "full"):
        assert {("fastpo", mode, m) for m in ("time", "pct_of_gemm", "pct_of_spec_peak", "peak_memory")} <= got
        (failed,) = [r for r in rows if r["provider"] == "oom" and r["mode"] == mode]
        assert failed["metric"] == "time" and math.isnan(failed["p50"]) and "out of memory" in failed["config"]
    pct = next(r for r in rows if r["provider"] == "fastpo" and r["mode"] == "full" and r["metric"] == "pct_of_gemm")
    gemm = next(r for r in rows if r["provider"] == "cublas-gemm" and r["mode"] == "full")
    fastpo = next(r for r in rows if r["provider"] == "fastpo" and r["mode"] == "full" and r["metric"] == "time")
    assert pct["p50"] == pytest.approx(100 * gemm["p50"] / fastpo["p50"])
    assert "fastpo" in bench_kernels.fused_logprob_variants()  # the A/B hook holds the shipped kernel


def test_spec_peak_by_device_name():
    sys.path.insert(0, str(BENCH))
    import bench_kernels

    assert bench_kernels.spec_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench_kernels.spec_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench_kernels.spec_peak_tflops("NVIDIA H200") == 989.0
    assert math.isnan(bench_kernels.spec_peak_tflops("NVIDIA GeForce RTX 4090"))  # not listed: no guessed figure
