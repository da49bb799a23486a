"""bench/bench_async.py's command line and row writing (the measurements themselves run in the GPU suite's dry run,
tests/test_gpu_suite.py). Not timed."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_async as ba  # noqa: E402


def test_device_is_refused_for_vllm_at_the_command_line(capsys):
    with pytest.raises(SystemExit) as err:
        ba.parse_args(["--engine", "vllm", "--device", "cuda", "--no-csv"])
    assert err.value.code == 2
    assert "--device cuda applies to the built-in engine (--engine hf)" in capsys.readouterr().err


def test_cuda_without_a_device_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(ba, "ARGS", ba.parse_args(["--device", "cuda", "--no-csv"]))
    monkeypatch.setattr(ba.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ba, "longtail_setup", lambda *a: pytest.fail("set up a workload before refusing"))
    with pytest.raises(SystemExit, match=r"--device cuda: torch sees no CUDA device"):
        ba.main()


def test_a_run_cut_short_keeps_the_rows_of_the_measurements_it_finished(tmp_path, monkeypatch):
    """The long-tail rows are in the CSV before the tiny workload starts: a run killed there (a stage timeout)
    loses only what it had not finished."""
    out = tmp_path / "results"
    monkeypatch.setattr(ba, "ARGS", ba.parse_args(["--workload", "longtail", "tiny", "--results-dir", str(out),
                                                   "--allow-dirty"]))
    monkeypatch.setattr(ba, "longtail_setup", lambda args, root: "longtail")
    monkeypatch.setattr(ba, "tiny_setup", lambda args, root: "tiny")

    def measure(setup, args, repeats):
        if setup == "tiny":
            raise KeyboardInterrupt  # what a timeout's signal does to the run
        return [dict(name="rollout_x", provider="fastpo-hf", mode="async/lockstep", metric="trajectories_per_s_ratio",
                     unit="x", x_name="repeats", x_value=repeats, p50=1.5, p20=1.5, p80=1.5, config="{}")]

    monkeypatch.setattr(ba, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        ba.main()
    rows = list(csv.DictReader((out / "async_rollout.csv").open()))
    assert [(r["name"], r["metric"], float(r["p50"])) for r in rows] == [("rollout_x", "trajectories_per_s_ratio", 1.5)]
    assert rows[0]["device"] and "cores" in rows[0]["device"]  # --device cpu: the CPU's name, even beside a GPU
