"""bench/plot_seeds.py: a run folder's validation points into the CSV, the mean over seeds at common iterations,
and the PNG."""

import csv
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def plot_seeds(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import plot_seeds

    return plot_seeds


def _run(folder: Path, points: dict[int, dict[str, float]]) -> Path:
    folder.mkdir()
    rows = []
    for step in range(0, max(points) + 1):
        row = {"step": step, "rollout/reward": 0.1 * step}
        row.update({f"val-env/{env}/success": v for env, v in points.get(step, {}).items()})
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_add_keeps_every_validation_and_averages_envs(tmp_path, plot_seeds):
    run = _run(tmp_path / "a", {0: {"FrozenLake": 0.5, "Sokoban": 0.25}, 2: {"FrozenLake": 0.75, "Sokoban": 0.5}})
    out = tmp_path / "v.csv"
    assert plot_seeds.main(["add", str(out), str(run), "--config", "GRPO", "--seed", "2", "--commit", "abc"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["config"], r["seed"], r["commit"], r["iteration"], r["success"]) for r in rows] == [
        ("GRPO", "2", "abc", "0", "37.50"), ("GRPO", "2", "abc", "2", "62.50")]
    # the same config and seed twice is refused, and the file is left as it was
    assert plot_seeds.main(["add", str(out), str(run), "--config", "GRPO", "--seed", "2", "--commit", "x"]) == 2
    assert len(list(csv.DictReader(out.open()))) == 2


def test_run_without_validation_is_an_error(tmp_path, plot_seeds):
    run = _run(tmp_path / "a", {3: {}})
    assert plot_seeds.main(["add", str(tmp_path / "v.csv"), str(run), "--config", "G", "--seed", "1",
                            "--commit", "c"]) == 2
    assert not (tmp_path / "v.csv").exists()


def test_seed_means_use_the_iterations_every_seed_has(plot_seeds):
    curves = {("GRPO", 1): [(0, 40.0), (30, 50.0)],              # a sparse run (entered from a table)
              ("GRPO", 2): [(0, 44.0), (10, 47.0), (30, 60.0)],  # a dense one
              ("GAE", 1): [(0, 10.0), (10, 20.0)]}
    means = plot_seeds.seed_means(curves)
    assert means["GRPO"] == [(0, 42.0, 2), (30, 55.0, 2)]
    assert means["GAE"] == [(0, 10.0, 1), (10, 20.0, 1)]


def test_plot_writes_a_png(tmp_path, plot_seeds):
    pytest.importorskip("matplotlib")
    out = tmp_path / "v.csv"
    for seed, base in ((1, 0.4), (2, 0.5)):
        run = _run(tmp_path / f"s{seed}", {0: {"FrozenLake": base}, 10: {"FrozenLake": base + 0.1}})
        plot_seeds.add(str(out), str(run), "GiGPO", seed, "c")
    png = tmp_path / "f.png"
    assert plot_seeds.main(["plot", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
