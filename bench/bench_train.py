"""One training iteration, phase by phase: the real entry point (``fastpo.train``) on a preset, timed from the
per-phase timings the trainer logs to metrics.jsonl.

    OMP_NUM_THREADS=1 python bench/bench_train.py                                  # tiny preset, FrozenLake, 1 process
    python bench/bench_train.py --nproc 2 --env sokoban --iterations 6             # torchrun, 2 ranks, 5-turn Sokoban
    python bench/bench_train.py -- --algorithm.adv_estimator gae                   # extra trainer overrides after --

Validation is switched off so every timed iteration is the same work (rollout -> filter -> logprob/values ->
advantages -> update -> weight sync). The first ``--warmup`` iterations are dropped; the table gives the median
(p20, p80) of each phase over the rest, its share of the iteration, and trained/rollout tokens per second. Rows go
to bench/results/train.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_allow_dirty, append_rows, quantiles, require_clean_tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_training(args, run_dir: Path) -> list[dict]:
    train_args = ["--preset", args.preset, "--trainer.run_dir", str(run_dir),
                  "--trainer.iterations", str(args.iterations), "--trainer.val_every", "0",
                  "--trainer.val_before_train", "false", "--trainer.save_every", "0"]
    if args.env:  # the preset's env keywords (e.g. tiny's is_slippery) belong to its own env
        train_args += ["--env.names", args.env, "--env.kwargs", "{}"]
    train_args += args.extra
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "fastpo.train", *train_args]
    else:
        cmd = [sys.executable, "-m", "fastpo.train", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Run outside the checkout so the repository root is not on sys.path (see kernels/__init__.py).
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--env", default=None, help="override env.names (e.g. sokoban)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("extra", nargs="*", help="extra trainer overrides (after --)")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if not args.no_save:
        require_clean_tree(args.allow_dirty)
    if args.iterations <= args.warmup:
        sys.exit(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup})")

    with tempfile.TemporaryDirectory() as tmp:
        records = run_training(args, Path(tmp) / "run")
    timed = [r for r in records if r.get("timing/iteration") is not None][args.warmup:]
    if not timed:
        sys.exit("no timed iterations in metrics.jsonl")
    phases = sorted({k for r in timed for k in r if k.startswith("timing/")})
    total = quantiles([r["timing/iteration"] for r in timed])[0]
    config = (f"preset={args.preset} env={args.env or 'preset'} nproc={args.nproc} iterations={len(timed)} "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')} {' '.join(args.extra)}").strip()
    rows = []
    print(f"{'phase':22s} {'p50 s':>9s} {'p20':>9s} {'p80':>9s} {'share':>7s}")
    for key in phases:
        values = [r[key] for r in timed if r.get(key) is not None]
        p50, p20, p80 = quantiles(values)
        print(f"{key:22s} {p50:9.3f} {p20:9.3f} {p80:9.3f} {p50 / total:7.1%}")
        rows.append(dict(name="iteration", provider="fastpo", mode=key.split("/", 1)[1], metric="time", unit="s",
                         x_name="nproc", x_value=args.nproc, p50=p50, p20=p20, p80=p80, config=config))
    for key, label in (("perf/tokens_per_s", "trained tokens/s"), ("perf/rollout_tokens", "rollout tokens")):
        values = [r[key] for r in timed if r.get(key) is not None]
        if values:
            p50, p20, p80 = quantiles(values)
            print(f"{label:22s} {p50:9.0f} {p20:9.0f} {p80:9.0f}")
            rows.append(dict(name="iteration", provider="fastpo", mode="full", metric=key, unit="1/s" if "per_s"
                             in key else "tokens", x_name="nproc", x_value=args.nproc, p50=p50, p20=p20, p80=p80,
                             config=config))
    if not args.no_save:
        print(f"appended {len(rows)} rows to {append_rows('train', rows)}")


if __name__ == "__main__":
    main()
