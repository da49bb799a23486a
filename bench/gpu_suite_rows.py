"""Result rows of bench/gpu_suite.sh's train and gap stages, read from the training run's metrics.jsonl.

    python bench/gpu_suite_rows.py train RUN_DIR --results-dir OUTDIR [--dry]   # validation before / after
    python bench/gpu_suite_rows.py gap RUN_DIR --results-dir OUTDIR             # engine vs trainer logprob gap

Rows go to ``OUTDIR/results.csv`` (bench/common.py's columns, the same file as the kernel rows), so the suite
returns one CSV. ``train`` exits 1 when the run did not finish both validations, or (not ``--dry``) when validation
success did not rise: the stage's claim is that the run learns. ``gap`` exits 1 without a finite gap.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_rows, quantiles, require_clean_tree  # noqa: E402

#: The metric the trainer logs per step: mean |sampling logprob - trainer logprob| over trained tokens (nats).
GAP_KEY = "rollout/logprob_gap_mean"
GAP_MAX_KEY = "rollout/logprob_gap_max"


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (one per logged step), in file order."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"no {path}: the training run did not log a step")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validation(rows: list[dict]) -> dict[int, float]:
    """{step: mean validation success over the validation envs} for the steps that validated."""
    out: dict[int, float] = {}
    for row in rows:
        values = [v for k, v in row.items() if k.startswith("val-env/") and k.endswith("/success")]
        if values:
            out[int(row["step"])] = float(statistics.fmean(values))
    return out


def _row(name, metric, unit, x_name, x_value, stats, config) -> dict:
    p50, p20, p80 = stats
    return dict(name=name, provider="fastpo", mode="train", metric=metric, unit=unit, x_name=x_name,
                x_value=x_value, p50=p50, p20=p20, p80=p80, config=config)


def train_rows(rows: list[dict], dry: bool) -> tuple[list[dict], str | None]:
    """(rows, error): validation success before and after, and the gain in points. `error` is None when the run
    validated at its first and last step and (unless `dry`) the success rose."""
    val = validation(rows)
    steps = sorted(val)
    if len(steps) < 2:
        return [], f"the run validated at steps {steps}; the stage needs a validation before and after training"
    first, last = steps[0], steps[-1]
    gain = 100 * (val[last] - val[first])
    config = f"validation success, steps {first} -> {last}, bf16 under FSDP2"
    out = [_row("train_validation", "success_before", "%", "step", first, (100 * val[first],) * 3, config),
           _row("train_validation", "success_after", "%", "step", last, (100 * val[last],) * 3, config),
           _row("train_validation", "success_gain", "points", "steps", last - first, (gain,) * 3, config)]
    print(f"validation success {100 * val[first]:.1f}% (step {first}) -> {100 * val[last]:.1f}% (step {last}): "
          f"{gain:+.1f} points")
    if not dry and gain <= 0:
        return out, f"validation success did not rise ({gain:+.1f} points over {last - first} steps)"
    return out, None


def gap_rows(rows: list[dict]) -> tuple[list[dict], str | None]:
    """(rows, error): the per-step mean logprob gap (p50 / p20 / p80 over steps), its value at the first step
    (same weights on both sides: numerics only), and the largest per-token gap seen."""
    steps = [r for r in rows if math.isfinite(r.get(GAP_KEY, math.nan))]
    if not steps:
        return [], f"no finite {GAP_KEY} in the run's metrics"
    gaps = [float(r[GAP_KEY]) for r in steps]
    peak = max(float(r.get(GAP_MAX_KEY, math.nan)) for r in steps)
    config = "engine sampling logprob vs trainer logprob, same tokens, bf16 (HF engine; FSDP2 mixed precision)"
    out = [dict(_row("logprob_gap", "mean_abs", "nats", "steps", len(gaps), quantiles(gaps), config), mode="per-step"),
           dict(_row("logprob_gap", "mean_abs", "nats", "step", int(steps[0]["step"]), (gaps[0],) * 3, config),
                mode="first-step"),
           dict(_row("logprob_gap", "max_abs", "nats", "steps", len(gaps), (peak,) * 3, config), mode="max")]
    print(f"logprob gap engine vs trainer: first step {gaps[0]:.3g}, median over {len(gaps)} steps "
          f"{statistics.median(gaps):.3g}, max per token {peak:.3g} nats")
    return out, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("train", "gap"))
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--results-dir", type=Path, required=True, help="where results.csv is appended to")
    ap.add_argument("--dry", action="store_true", help="train: a dry run's few steps need not learn")
    args = ap.parse_args(argv)
    require_clean_tree(allow_dirty=True)  # the suite's rows are stamped <hash>+dirty from an uncommitted tree
    rows = read_metrics(args.run_dir)
    out, error = train_rows(rows, args.dry) if args.what == "train" else gap_rows(rows)
    if out:
        append_rows("results", out, args.results_dir)
    if error:
        print(f"{args.what}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
