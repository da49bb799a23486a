"""Shared benchmark helpers: timing, machine stamping, the clean-tree check and the CSV row writer.

Usage from another script in bench/::

    from common import append_rows, time_median
    p50, p20, p80 = time_median(lambda: work(), repeats=5)          # seconds
    append_rows("envs", [dict(name="sokoban_step", provider="fastpo", mode="forward", metric="time", unit="s",
                              x_name="num_envs", x_value=1024, p50=p50, p20=p20, p80=p80, config="...")])

``append_rows(subject, rows)`` appends to ``bench/results/<subject>.csv`` (header written once) and stamps each
row with device, commit, timestamp and versions; missing columns are left empty. Imports only the standard
library (torch / triton versions are read when already imported, or looked up lazily).

A figure is only reproducible if its commit can be checked out, so rows are not written from a work tree with
uncommitted changes (files under ``bench/results/`` do not count: they are the output). Every script calls
``require_clean_tree(args.allow_dirty)`` right after parsing its arguments (``add_allow_dirty(parser)`` adds the
flag), so it stops before measuring; with ``--allow-dirty`` it warns and its rows are stamped ``<hash>+dirty``.
``append_rows`` checks again and raises :class:`DirtyTreeError` for a script that skipped the first check.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

COLUMNS = ["name", "provider", "mode", "metric", "unit", "x_name", "x_value", "p50", "p20", "p80", "config",
           "device", "commit", "timestamp", "versions"]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
try:
    from fastpo import provenance
except ImportError:  # a checkout without an install: its own package (appended, so an install would win)
    sys.path.append(str(REPO))
    from fastpo import provenance


def quantiles(samples: Iterable[float]) -> tuple[float, float, float]:
    """(p50, p20, p80) of the samples (inclusive method; a single sample gives it three times)."""
    data = sorted(samples)
    if len(data) == 1:
        return data[0], data[0], data[0]
    q = statistics.quantiles(data, n=10, method="inclusive")
    return statistics.median(data), q[1], q[7]


def time_median(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """Run ``fn`` warmup + repeats times; (p50, p20, p80) wall seconds of the timed runs. Pass
    ``sync=torch.cuda.synchronize`` for GPU work (called before starting and stopping each clock)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - start)
    return quantiles(samples)


def device_name(cpu: bool = False) -> str:
    """GPU name when torch sees one (and ``cpu`` is False: the run used it), else the CPU model and core count."""
    torch = sys.modules.get("torch")
    if not cpu and torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"{model} x{os.cpu_count()} cores (OMP_NUM_THREADS={threads})"


#: Set by require_clean_tree(allow_dirty=True); an environment variable so that child processes inherit it.
ALLOW_DIRTY_ENV = "FASTPO_BENCH_ALLOW_DIRTY"
#: Changes under these paths (relative to the repository root) do not make a tree dirty: they are the results.
OUTPUT_PATHS = ("bench/results/",)


class DirtyTreeError(RuntimeError):
    """Benchmark rows were about to be written from a work tree with uncommitted changes."""


def uncommitted_files(repo: str | os.PathLike | None = None) -> list[str] | None:
    """Paths (relative to the repository root) with uncommitted changes, untracked files included and
    :data:`OUTPUT_PATHS` left out; None outside a git work tree."""
    return provenance.uncommitted_files(repo or REPO, OUTPUT_PATHS)


def git_commit(repo: str | os.PathLike | None = None) -> str:
    """Short HEAD hash, '+dirty' when the work tree has changes outside bench/results; 'unknown' outside git."""
    state = provenance.source_state(repo or REPO, OUTPUT_PATHS)
    if state is None:
        return "unknown"
    return state["short"] + ("+dirty" if state["dirty"] else "")


def add_allow_dirty(parser: argparse.ArgumentParser) -> None:
    """Add ``--allow-dirty`` (measure an uncommitted tree anyway; rows are stamped +dirty) to a script's parser."""
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on a tree with uncommitted changes: warn and stamp the rows <hash>+dirty "
                             "(default: refuse, since such a figure cannot be reproduced from its commit)")


def require_clean_tree(allow_dirty: bool = False, repo: str | os.PathLike | None = None) -> str:
    """Refuse to benchmark an uncommitted tree: SystemExit naming the changed files unless ``allow_dirty``, in
    which case a warning goes to stderr and rows are allowed (and stamped +dirty). Returns the commit stamp."""
    changed = uncommitted_files(repo)
    commit = git_commit(repo)
    if not changed:
        return commit
    listing = ", ".join(changed[:8]) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
    if not allow_dirty:
        raise SystemExit(f"refusing to benchmark: the work tree has uncommitted changes ({listing}); commit them "
                         "so the figures can be reproduced from the commit, or pass --allow-dirty to measure anyway "
                         "(rows are then stamped +dirty)")
    os.environ[ALLOW_DIRTY_ENV] = "1"
    print(f"WARNING: benchmarking an uncommitted tree ({listing}); rows are stamped {commit} and cannot be "
          "reproduced from their commit", file=sys.stderr, flush=True)
    return commit


def status_kib(field: str) -> int:
    """A field of this process's /proc/self/status in KiB (``VmRSS`` now, ``VmHWM`` its peak): Linux only."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def pin_threads(threads: int) -> None:
    """Size the OpenMP / MKL pools and keep the hub and tokenizers offline and single-threaded. Call it before torch
    is imported: the pool is sized at import."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def versions() -> str:
    parts = [f"python={platform.python_version()}"]
    for name in ("torch", "triton"):
        mod = sys.modules.get(name)
        if mod is not None:
            parts.append(f"{name}={getattr(mod, '__version__', '?')}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.version.cuda:
        parts.append(f"cuda={torch.version.cuda}")
    return " ".join(parts)


def append_rows(subject: str, rows: list[dict], results_dir: str | os.PathLike | None = None) -> Path:
    """Append rows to ``<results_dir or bench/results>/<subject>.csv`` with the :data:`COLUMNS`, stamped with
    device, commit, timestamp (UTC, ISO 8601) and versions. Returns the CSV path. Raises :class:`DirtyTreeError`
    on an uncommitted tree unless :func:`require_clean_tree` allowed it."""
    commit = git_commit()
    if commit.endswith("+dirty") and os.environ.get(ALLOW_DIRTY_ENV) != "1":
        raise DirtyTreeError(f"not writing {subject} rows from an uncommitted tree ({commit}): commit first, or run "
                             "the script with --allow-dirty (require_clean_tree) to stamp them +dirty")
    out_dir = Path(results_dir) if results_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{subject}.csv"
    stamp = {"device": device_name(), "commit": commit, "versions": versions(),
             "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**{c: "" for c in COLUMNS}, **stamp, **row})
    return path


def print_table(rows: list[dict], columns=("name", "provider", "mode", "metric", "x_value", "p50", "p20", "p80",
                                           "unit")) -> None:
    """Print rows as an aligned text table (floats with 4 significant digits)."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
