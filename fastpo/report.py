"""End-of-run report from a run folder's ``metrics.jsonl``: per-env validation success before vs after, a
training-curve PNG, and where the Hugging Face export is.

    python -m fastpo.report runs/demo                 # prints the table, writes runs/demo/curves.png
    python -m fastpo.report runs/a runs/b --compare docs/pair.png --labels "stable,collapses"   # overlaid
    from fastpo.report import load_metrics, success_table, plot_curves, format_report
    rows = load_metrics("runs/demo")
    table = success_table(rows)                        # [EnvSuccess("FrozenLake", 0.18, 0.33, 0, 60)]
    plot_curves(rows, "runs/demo/curves.png")

The trainer writes one ``metrics.jsonl`` row per iteration (``{"step": s, ...}``) and, with
``trainer.val_before_train``, a step-0 row holding only validation metrics. "Before" is the first row with
``val-env/<Env>/success``, "after" the last one; both come from RAGEN's validation protocol (fixed seeds,
``rollout.val_temperature``), so the difference is the effect of training on the same initial states.
``fastpo.train`` calls :func:`write_report` on rank 0 when a run ends; this module only reads files, so it
also works on a run copied from another machine.

The PNG has one panel per signal of docs/SEMANTICS.md section 7 (the Echo Trap's early signs) plus success: training and
validation success, mean trajectory reward, in-group reward std (collapse drives it to 0), actor entropy and
actor grad norm, each against the iteration. Panels whose metric a run never logged (e.g. grad norm of a run
with no update) say "not logged" instead of being left out, so the layout is the same for every run.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli import Positional
from .model_path import resolve_model_path

#: (title, metric keys tried in order) of the PNG panels after the success panel.
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mean trajectory reward", ("rollout/reward",)),
    ("in-group reward std", ("rollout/in_group_std",)),
    ("actor entropy", ("actor/entropy", "actor/entropy_loss")),  # the second: trainer.metric_names ragen
    ("actor grad norm", ("actor/grad_norm",)),
)
_VAL_SUCCESS = re.compile(r"^val-env/(?P<env>[^/]+)/success$")
_TRAIN_SUCCESS = re.compile(r"^(?:env|train)/(?P<env>[^/]+)/success$")  # train/: trainer.metric_names ragen


@dataclass(frozen=True)
class EnvSuccess:
    """Validation success of one env at the first and the last validation of a run (fractions in [0, 1])."""

    env: str
    before: float
    after: float
    before_step: int
    after_step: int

    @property
    def delta_points(self) -> float:
        """after - before in percentage points."""
        return 100.0 * (self.after - self.before)


class MetricsFileError(ValueError):
    """A metrics.jsonl that is not the trainer's: binary data, or a row whose ``step`` is not an integer."""


def load_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``<run_dir>/metrics.jsonl`` in file order (a truncated last line, e.g. from a killed run, is
    skipped, and so is a line that is not a JSON object with a ``step``). Raises FileNotFoundError naming the path
    when the run folder has no metrics file, MetricsFileError (one line naming the file and the line) for a line
    that is not UTF-8 text or a ``step`` that is not an integer."""
    from .config import shown

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run folder written by fastpo.train (--trainer.run_dir)")
    rows = []
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, 1):
        torn = n == len(lines)  # no newline after it: a killed run's partial write (a multi-byte char may be cut)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            if torn:
                continue
            raise MetricsFileError(f"{path} is not a metrics file: line {n} is not UTF-8 text (binary data?); pass "
                                   f"a run folder written by fastpo.train") from None
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        if isinstance(row["step"], bool) or not isinstance(row["step"], int):
            raise MetricsFileError(f"{path} line {n}: step must be an integer (the iteration), got "
                                   f"{shown(row['step'])}")
        rows.append(row)
    return rows


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def val_success_mean(row: dict[str, Any]) -> float | None:
    """Validation success of one metrics row, mean over its envs (a fraction in [0, 1]); None when the row holds
    no finite ``val-env/<env>/success`` value (a training-only row, or every env's value NaN)."""
    vals = [float(v) for key, v in row.items() if _VAL_SUCCESS.match(key) and _finite(v)]
    return sum(vals) / len(vals) if vals else None


def success_table(rows: Sequence[dict[str, Any]]) -> list[EnvSuccess]:
    """Per validation env (sorted by name): success at the first and at the last validation row. Envs validated
    only once get before == after. Empty when the run never validated."""
    first: dict[str, tuple[int, float]] = {}
    last: dict[str, tuple[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            m = _VAL_SUCCESS.match(key)
            if m and _finite(value):
                env = m.group("env")
                first.setdefault(env, (int(row["step"]), float(value)))
                last[env] = (int(row["step"]), float(value))
    return [EnvSuccess(env, first[env][1], last[env][1], first[env][0], last[env][0]) for env in sorted(first)]


def format_table(table: Sequence[EnvSuccess], n_val: int | None = None) -> str:
    """The success table as aligned text (percentages; the delta in points)."""
    if not table:
        return "no validation results in this run (trainer.val_every = 0 and val_before_train off?)"
    head = f"validation success{f' ({n_val} fixed initial states)' if n_val else ''}"
    lines = [head, f"{'env':<24} {'before':>8} {'after':>8} {'change':>9}"]
    for r in table:
        lines.append(f"{r.env:<24} {100 * r.before:>7.1f}% {100 * r.after:>7.1f}% {r.delta_points:>+7.1f} pt"
                     f"   (step {r.before_step} -> {r.after_step})")
    return "\n".join(lines)


def _series(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> tuple[list[int], list[float], str | None]:
    """(steps, values, key) of the first key in `keys` with any finite value; training rows only (step >= 1)."""
    for key in keys:
        pts = [(int(r["step"]), float(r[key])) for r in rows if r["step"] >= 1 and _finite(r.get(key))]
        if pts:
            return [p[0] for p in pts], [p[1] for p in pts], key
    return [], [], None


def _save_figure(fig: Any, axes: Sequence[Any], out: str | os.PathLike, title: str | None) -> Path:
    """Label every panel's x axis, add the title, write the PNG and close the figure."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_curves(rows: Sequence[dict[str, Any]], out: str | os.PathLike, title: str | None = None) -> Path:
    """Write the training-curve PNG (matplotlib, Agg backend) to `out`; returns its path.

    Panels: success (training rollouts per env as lines, validation per env as markers), then CURVES."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(CURVES), figsize=(4.0 * (1 + len(CURVES)), 3.4), squeeze=False)
    axes = axes[0]
    ax = axes[0]
    train_keys = sorted({k for r in rows for k in r if _TRAIN_SUCCESS.match(k)})
    for key in train_keys:
        steps, values, _ = _series(rows, (key,))
        ax.plot(steps, values, label=f"train {_TRAIN_SUCCESS.match(key).group('env')}", lw=1.2)
    val_keys = sorted({k for r in rows for k in r if _VAL_SUCCESS.match(k)})
    for key in val_keys:
        pts = [(int(r["step"]), float(r[key])) for r in rows if _finite(r.get(key))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--", ms=4,
                label=f"val {_VAL_SUCCESS.match(key).group('env')}")
    ax.set_title("success")
    ax.set_ylim(-0.02, 1.02)
    if train_keys or val_keys:
        ax.legend(fontsize=7)
    for ax, (name, keys) in zip(axes[1:], CURVES, strict=True):
        steps, values, key = _series(rows, keys)
        if key is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.plot(steps, values, lw=1.2)
        ax.set_title(name)
    return _save_figure(fig, axes, out, title)


def plot_compare(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike,
                 title: str | None = None) -> Path:
    """Overlay several runs' curves in one PNG (one colour per run): validation success (mean over envs, markers),
    then the CURVES panels (the Echo Trap signals). `runs`: (label, metrics rows) pairs; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(CURVES), figsize=(4.0 * (1 + len(CURVES)), 3.4), squeeze=False)
    axes = axes[0]
    for k, (label, rows) in enumerate(runs):
        color = f"C{k % 10}"
        val = [(int(r["step"]), m) for r in rows if (m := val_success_mean(r)) is not None]
        axes[0].plot([p[0] for p in val], [p[1] for p in val], "o-", ms=3, lw=1.0, color=color, label=label)
        for ax, (_, keys) in zip(axes[1:], CURVES, strict=True):
            steps, values, key = _series(rows, keys)
            if key is not None:
                ax.plot(steps, values, lw=1.0, color=color, label=label)
    axes[0].set_title("validation success")
    axes[0].set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=7)
    for ax, (name, _) in zip(axes[1:], CURVES, strict=True):
        ax.set_title(name)
    return _save_figure(fig, axes, out, title)


def _n_val(run_dir: Path) -> int | None:
    """Validation states per env from the run's resolved config (None when it cannot be read)."""
    from .config_io import load_json

    try:
        env = load_json((run_dir / "config.json").read_bytes(), "config.json")["env"]  # bounded: never a crash
        names = env.get("val_names") or env["names"]
        return int(env["val_groups"]) * int(env.get("val_group_size", 1)) // max(1, len(names))
    except (OSError, KeyError, ValueError, TypeError):
        return None


def format_report(run_dir: str | os.PathLike, png: Path | None, rows: Sequence[dict[str, Any]]) -> str:
    """The text printed at the end of a run: the success table, the PNG path and the HF export path."""
    run_dir = Path(run_dir)
    lines = [format_table(success_table(rows), _n_val(run_dir))]
    if png is not None:
        lines.append(f"training curves: {png}")
    try:  # what eval / sft would load from the run folder: its finished export
        export = resolve_model_path(run_dir)
        lines.append(f"Hugging Face export: {export}   (python -m fastpo.eval --model.path {run_dir})")
    except ValueError:
        lines.append(f"Hugging Face export: none under {run_dir / 'hf'} (the run did not finish)")
    return "\n".join(lines)


def write_report(run_dir: str | os.PathLike, png_name: str = "curves.png") -> str:
    """Read ``<run_dir>/metrics.jsonl``, write ``<run_dir>/<png_name>`` and ``<run_dir>/report.txt``; return the
    report text. The PNG is skipped (and the text says so) when matplotlib is not installed."""
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    png: Path | None = None
    try:
        png = plot_curves(rows, run_dir / png_name, title=str(run_dir))
    except ImportError:
        pass
    text = format_report(run_dir, png, rows)
    if png is None:
        text += "\n(training curves skipped: matplotlib is not installed)"
    (run_dir / "report.txt").write_text(text + "\n")
    return text


@dataclass
class ReportArgs:
    """``python -m fastpo.report RUN [RUN ...]``."""

    runs: Positional[tuple[str, ...]] = ()
    """Run folders written by fastpo.train (several with --compare)."""
    png: str = "curves.png"
    """PNG file name inside the run folder."""
    compare: str = ""
    """Write one PNG overlaying every run's curves to this path ("" = one report per run)."""
    labels: tuple[str, ...] = ()
    """Legend labels for --compare, one per run (default: the paths)."""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: the report of one run, or the comparison PNG of several; bad input exits 2 with one ``error:``
    line."""
    from .cli import parse
    from .cli_schema import describe
    from .config import ConfigError

    try:
        args = parse(ReportArgs, argv, prog="python -m fastpo.report",
                     description=describe("Per-env validation success before vs after training, the training "
                                          "curves (PNG) and where the export is, from a run folder."))
        if not args.runs:
            raise ConfigError("give a run folder (or several with --compare PNG)")
        if args.compare:
            labels = list(args.labels) or list(args.runs)
            if len(labels) != len(args.runs):
                raise ConfigError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
            runs = [(label, load_metrics(d)) for label, d in zip(labels, args.runs, strict=True)]
            for label, d in zip(labels, args.runs, strict=True):
                print(f"{label}:\n{format_table(success_table(load_metrics(d)), _n_val(Path(d)))}")
            print(f"wrote {plot_compare(runs, args.compare)}")
            return 0
        if len(args.runs) != 1:
            raise ConfigError("several run folders need --compare PNG")
        print(write_report(args.runs[0], args.png))
    except (ConfigError, FileNotFoundError, MetricsFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
