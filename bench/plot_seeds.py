"""Validation curves of several configs x training seeds, from a committed CSV (so a figure can be redrawn after
the run folders are gone).

    # append a run's validation points (every validation of the run) to the CSV
    python bench/plot_seeds.py add docs/data/fl_estimators.csv runs/grpo-s2 --config GRPO --seed 2 --commit 729e2c7
    # one panel: each config's mean over its seeds (thick) and every seed (thin)
    python bench/plot_seeds.py plot docs/data/fl_estimators.csv --out docs/fl_estimators.png

CSV columns: ``config, seed, commit, iteration, success`` (success in percent, mean over the run's envs). A run
whose folder was lost can be entered by hand from a results table at the iterations it lists; the mean over
seeds is drawn only at iterations every seed of that config has, so sparse and dense runs can be mixed.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastpo.report import load_metrics, val_success_mean  # noqa: E402

FIELDS = ("config", "seed", "commit", "iteration", "success")


def run_points(run_dir: str | Path) -> list[tuple[int, float]]:
    """(iteration, validation success in percent, mean over envs) of every validation row of a run folder."""
    points = []
    for row in load_metrics(run_dir):
        mean = val_success_mean(row)
        if mean is not None:
            points.append((int(row["step"]), 100.0 * mean))
    if not points:
        raise ValueError(f"{run_dir}: no validation rows in metrics.jsonl")
    return points


def read_csv(path: str | Path) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(config, seed) -> sorted [(iteration, success %)] from the CSV."""
    curves: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            curves[(row["config"], int(row["seed"]))].append((int(row["iteration"]), float(row["success"])))
    return {k: sorted(v) for k, v in curves.items()}


def seed_means(curves: dict[tuple[str, int], list[tuple[int, float]]]) -> dict[str, list[tuple[int, float, int]]]:
    """config -> [(iteration, mean success over seeds, number of seeds)] at the iterations every seed of the
    config has."""
    by_config: dict[str, list[dict[int, float]]] = defaultdict(list)
    for (config, _seed), points in curves.items():
        by_config[config].append(dict(points))
    out = {}
    for config, seeds in by_config.items():
        common = sorted(set.intersection(*(set(s) for s in seeds)))
        out[config] = [(it, statistics.fmean(s[it] for s in seeds), len(seeds)) for it in common]
    return out


def add(csv_path: str, run_dir: str, config: str, seed: int, commit: str) -> int:
    """Append a run's validation points; refuses a (config, seed) the CSV already holds. Returns the row count."""
    path = Path(csv_path)
    if path.is_file() and (config, seed) in read_csv(path):
        raise ValueError(f"{path} already holds config {config!r} seed {seed}")
    points = run_points(run_dir)
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(FIELDS)
        writer.writerows((config, seed, commit, it, f"{s:.2f}") for it, s in points)
    return len(points)


def plot(csv_path: str, out: str, title: str) -> Path:
    """One panel: per config the mean over seeds (thick, markers) and each seed (thin); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    curves = read_csv(csv_path)
    means = seed_means(curves)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, config in enumerate(sorted(means)):
        color = f"C{k % 10}"
        for (c, _seed), points in sorted(curves.items()):
            if c == config:
                ax.plot([p[0] for p in points], [p[1] for p in points], lw=0.7, alpha=0.45, color=color)
        m = means[config]
        n = m[0][2] if m else 0
        ax.plot([p[0] for p in m], [p[1] for p in m], "o-", lw=2.0, ms=4, color=color,
                label=f"{config} (mean of {n} seeds)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation success (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="append a run folder's validation points to the CSV")
    a.add_argument("csv")
    a.add_argument("run")
    a.add_argument("--config", required=True)
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--commit", required=True)
    q = sub.add_parser("plot", help="draw the CSV")
    q.add_argument("csv")
    q.add_argument("--out", required=True)
    q.add_argument("--title", default="validation success, mean over training seeds (thin: each seed)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "add":
            print(f"added {add(args.csv, args.run, args.config, args.seed, args.commit)} points")
        else:
            print(f"wrote {plot(args.csv, args.out, args.title)}")
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
