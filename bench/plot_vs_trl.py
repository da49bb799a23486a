"""Plot the latest ``bench/bench_vs_trl.py`` run from ``bench/results/vs_trl.csv``: per model, the median seconds
per optimiser step of fastpo and TRL split into phases (generate / score / update / sync), with the speed-up on
top; and the peak RSS of each side.

    python bench/plot_vs_trl.py [--csv bench/results/vs_trl.csv] [--out docs/vs_trl.png]

"Latest run" = the rows with the newest timestamp among the ``grpo_mix`` step-time rows (one timestamp per run).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

PHASES = ("generate", "score", "update", "sync")
SIDES = ("fastpo", "trl")


def latest_run(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The grpo_mix rows of the newest run that measured both fastpo and TRL (by its step-time rows' timestamp;
    runs of one side only, e.g. ``--sides fastpo-vllm,fastpo``, are skipped)."""
    sides: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r["name"] == "grpo_mix" and r["metric"] == "step_time":
            sides[r["timestamp"]].add(r["provider"])
    both = [t for t, got in sides.items() if {"fastpo", "trl"} <= got]
    if not both:
        raise ValueError("no grpo_mix run with both fastpo and trl step times; run bench/bench_vs_trl.py first")
    newest = max(both)
    return [r for r in rows if r["name"] == "grpo_mix" and r["timestamp"] == newest]


def collect(rows: list[dict[str, str]]) -> dict[str, dict[str, dict[str, float]]]:
    """model -> side -> {"step": s, "rss": MB, <phase>: s}."""
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        side, model = r["provider"], r["x_value"]
        if side not in SIDES:
            continue
        if r["metric"] == "step_time" and r["mode"] == "full":
            out[model][side]["step"] = float(r["p50"])
        elif r["metric"] == "peak_rss":
            out[model][side]["rss"] = float(r["p50"])
        elif r["metric"] == "time" and r["mode"] in PHASES:
            out[model][side][r["mode"]] = float(r["p50"])
    return out


def plot(data: dict[str, dict[str, dict[str, float]]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    models = sorted(data, key=lambda m: data[m].get("fastpo", {}).get("step", 0.0))
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.2 * (len(models) + 1), 3.6), squeeze=False)
    axes = axes[0]
    for ax, model in zip(axes, models, strict=False):
        bottoms = [0.0, 0.0]
        for k, phase in enumerate(PHASES):
            vals = [data[model][side].get(phase, 0.0) for side in SIDES]
            ax.bar(SIDES, vals, bottom=bottoms, color=f"C{k}", label=phase)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        steps = [data[model][side].get("step", float("nan")) for side in SIDES]
        for x, s in enumerate(steps):
            ax.text(x, max(bottoms) * 1.02, f"{s:.3g} s", ha="center", fontsize=8)
        ax.set_title(f"{model}: fastpo {steps[1] / steps[0]:.2f}x TRL steps/s", fontsize=9)
        ax.set_ylabel("s per optimiser step (median; phases)")
        ax.set_ylim(0, max(bottoms) * 1.4)
        ax.legend(fontsize=7, ncol=4, loc="upper center")
    ax = axes[-1]
    width = 0.38
    for k, side in enumerate(SIDES):
        xs = [i + (k - 0.5) * width for i in range(len(models))]
        ax.bar(xs, [data[m][side].get("rss", 0.0) / 1024 for m in models], width, label=side, color=f"C{k + 5}")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("peak RSS (GB)")
    ax.set_title("memory", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", default="bench/results/vs_trl.csv")
    p.add_argument("--out", default="docs/vs_trl.png")
    args = p.parse_args(argv)
    rows = latest_run(list(csv.DictReader(open(args.csv))))
    data = collect(rows)
    missing = [(m, s) for m in data for s in SIDES if "step" not in data[m][s]]
    if missing:
        print(f"error: no step time for {missing} in the latest run", file=sys.stderr)
        return 2
    title = f"fastpo vs TRL GRPOTrainer, CPU, {rows[0]['device']}, {rows[0]['timestamp'][:16]} UTC"
    print(f"wrote {plot(data, Path(args.out), title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
