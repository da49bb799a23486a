"""Which FrozenLake levels a model fails: the validation states split by whether the solver's shortest safe path
needs a detour, each part run through the real validation (docs/results/log.md, "past the SFT plateau on
non-slippery FrozenLake").

    python bench/fl_failures.py --config runs/FLP_s1/config.json FL_SFT/step-500 runs/FLP_s1/hf ...
    python bench/fl_failures.py --config runs/FLP_s1/config.json --metrics runs/FLP_s1 runs/FLP_s2 runs/FLP_s3

A level is "detour" when the shortest safe path from the start (``envs.solvers.solve_frozenlake``) is longer than
the Manhattan distance from player to goal, i.e. a hole sits on every straight route; "direct" otherwise.
Each model is evaluated with the config's validation settings (``fastpo.eval.evaluate_entry``) on the detour
seeds and on the direct seeds apart; every episode keeps its request seed, so the two parts are exactly the
episodes of the full 256-state evaluation. ``--metrics`` instead reads finished runs' ``metrics.jsonl``:
entropy, training success and pass@8 over the first and last 10 iterations, i.e. whether RL widened the set of
levels a group solves or only sharpened the policy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envs.solvers import solve_frozenlake  # noqa: E402
from fastpo import envs  # noqa: E402
from fastpo.eval import evaluate_entry, parse_args, prepare  # noqa: E402


def level_kind(desc: np.ndarray, position: int) -> str:
    """"detour" or "direct" for a map ``desc`` (``uint8[S, S]`` ASCII ``S F H G``) and a player cell
    ``row * S + col``: detour when the shortest safe path is longer than the Manhattan distance to the goal."""
    size = desc.shape[1]
    goal = int(np.flatnonzero(np.asarray(desc).reshape(-1) == ord("G"))[0])
    path = solve_frozenlake(desc, int(position))
    manhattan = abs(goal // size - int(position) // size) + abs(goal % size - int(position) % size)
    return "detour" if path is not None and len(path) > manhattan else "direct"


def split_levels(name: str, seeds: list[int], kwargs: dict) -> dict[str, list[int]]:
    """``{"direct": [...], "detour": [...]}``: the env seeds of each kind of initial state."""
    env = envs.make(name, len(seeds), **kwargs)
    env.reset(np.asarray(seeds, dtype=np.int64))
    state = env.get_state()
    env.close()
    kinds: dict[str, list[int]] = {"direct": [], "detour": []}
    for seed, desc, position in zip(seeds, state["desc"], state["position"], strict=True):
        kinds[level_kind(desc, int(position))].append(seed)
    return kinds


def by_level(config: str, model: str) -> dict[str, tuple[float, int]]:
    """``{kind: (success, n)}`` of ``model`` under the validation of ``config``, plus ``"all"``."""
    args = parse_args(["--config", config, "--model.path", model])
    entries, tokenizer, policy, _ = prepare(args)
    if len(entries) != 1 or entries[0].name != "frozenlake":
        raise ValueError(f"{config} validates on {[e.name for e in entries]}: this split needs frozenlake alone")
    entry = entries[0]
    parts = split_levels(entry.name, [args.env.val_seed + g for g in entry.groups], entry.kwargs)
    out = {k: (evaluate_entry(args, policy, tokenizer, entry, seeds=v)["success"] if v else 0.0, len(v))
           for k, v in parts.items()}
    n = sum(c for _, c in out.values())
    out["all"] = (sum(s * c for s, c in out.values()) / n, n)
    return out


def window_means(metrics: list[dict], key: str) -> tuple[float, float]:
    values = [m[key] for m in metrics if key in m]
    if len(values) < 2:
        raise ValueError(f"metric {key!r} has {len(values)} values; need >= 2")
    k = min(10, len(values) // 2)
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


def trends(runs: list[str]) -> None:
    print("run | entropy first -> last 10 iterations | training success | pass@8")
    for run in runs:
        metrics = [json.loads(line) for line in (Path(run) / "metrics.jsonl").open()]
        cells = [window_means(metrics, k) for k in ("actor/entropy", "rollout/success", "rollout/pass@8")]
        print(f"{run} | " + " | ".join(f"{a:.3f} -> {b:.3f}" for a, b in cells))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="a run's config.json: the validation settings (required without --metrics)")
    ap.add_argument("--metrics", action="store_true", help="read the runs' metrics.jsonl instead of evaluating")
    ap.add_argument("paths", nargs="+", help="models (folders or run folders), or run folders with --metrics")
    args = ap.parse_args(argv)
    if args.metrics:
        trends(args.paths)
    elif not args.config:
        ap.error("--config is required to evaluate models (or pass --metrics)")
    else:
        print("model | direct: success (n) | detour: success (n) | all")
        for model in args.paths:
            row = by_level(args.config, model)
            print(f"{model} | " + " | ".join(f"{s:.1%} ({n})" for s, n in row.values()))

if __name__ == "__main__":
    main()
