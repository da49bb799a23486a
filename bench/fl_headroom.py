"""How much a FrozenLake agent can gain over shortest-path imitation: the success of the best turn policy and of
the solver's shortest path on a run's validation states, exact (dynamic programming over the slip distribution)
and as played in the env's own episodes (docs/results/log.md, "past the SFT plateau on slippery FrozenLake").

    python bench/fl_headroom.py --config runs/SFLP_s1/config.json
    python bench/fl_headroom.py --env.names frozenlake --env.kwargs '{}' --env.max_actions_per_turn 2  # eval's flags

Each validation state is valued with ``envs.fl_planning`` under the run's turn and action budgets: "optimal" is
the best an agent that sees the board after every turn can reach, "shortest" is the policy that SFT on the
solver's trajectories (``fastpo.sft --sft.turn_length max``) imitates. "expected" averages over the slips;
"played" runs each policy through the env on the exact validation episodes (the env draws its slips from the
level's seed, so these are the episodes ``fastpo.eval`` scores a model on, up to the model's own choices).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fastpo import config, envs  # noqa: E402
from fastpo.env_mix import EnvEntry, resolve_mix  # noqa: E402
from fastpo.envs.fl_planning import TurnPlanner  # noqa: E402
from fastpo.eval import parse_args  # noqa: E402

POLICIES = ("optimal", "shortest")


def action_budget(entry: EnvEntry) -> int:
    """The episode's action budget: the env's step limit, capped by the rollout's per-trajectory budget."""
    steps = int(entry.kwargs.get("max_steps", 10))
    return min(steps, entry.max_actions_per_traj) if entry.max_actions_per_traj else steps


def play(env: envs.BatchEnv, planners: list[TurnPlanner], turns: int, budget: int) -> np.ndarray:
    """``bool[N]``: whether each planner's policy reaches the goal in ``env``'s episodes (a FrozenLake batch of
    ``N`` instances, just reset; planner ``i`` built on instance ``i``'s map), playing turn by turn as the rollout
    does: the turn's actions one at a time until the episode ends, then the next turn from the new cell."""
    n = len(planners)
    done, success = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    used = np.zeros(n, dtype=np.int64)
    for turn in range(turns):
        position = env.get_state()["position"]
        plans = [() if done[i] else p.turn(int(position[i]), turns - turn, budget - int(used[i]))
                 for i, p in enumerate(planners)]
        done |= np.array([not plan for plan in plans])
        for j in range(max((len(p) for p in plans), default=0)):
            acts = np.array([p[j] if len(p) > j and not done[i] else 0 for i, p in enumerate(plans)], dtype=np.int32)
            stepping = acts > 0  # 0 is an invalid action: the env leaves that instance as it is
            _, _, terminated, truncated, info = env.step(acts, render=False)
            used += stepping
            success |= stepping & info["success"].astype(bool)
            done |= stepping & (terminated | truncated)
        if done.all():
            break
    return success


def headroom(entry: EnvEntry, val_seed: int) -> dict[str, dict[str, float]]:
    """``{policy: {"expected": mean success probability, "played": success rate}}`` over ``entry``'s validation
    states (seeds ``val_seed + group``)."""
    if entry.name != "frozenlake":
        raise ValueError(f"fl_headroom values FrozenLake only, got env {entry.name!r}")
    seeds = np.array([val_seed + g for g in entry.groups], dtype=np.int64)
    env = envs.make("frozenlake", len(seeds), **entry.kwargs)
    slippery = bool(entry.kwargs.get("is_slippery", True))
    per_turn, turns, budget = entry.max_actions_per_turn or 1, entry.max_turns, action_budget(entry)
    out = {}
    try:
        for policy in POLICIES:
            env.reset(seeds)
            state = env.get_state()
            planners = [TurnPlanner(d, per_turn, policy, slippery) for d in state["desc"]]
            expected = [p.value(int(c), turns, budget) for p, c in zip(planners, state["position"], strict=True)]
            out[policy] = {"expected": float(np.mean(expected)),
                           "played": float(play(env, planners, turns, budget).mean())}
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="a run's config.json (its validation settings)")
    args, rest = ap.parse_known_args(argv)
    eval_args = parse_args((["--config", args.config] if args.config else []) + rest)
    e = eval_args.env
    env_cfg = config.EnvConfig(**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
    print("env | states | turns x actions (budget) | policy | expected success | played on the validation episodes")
    for entry in resolve_mix(env_cfg, "val"):
        result = headroom(entry, e.val_seed)
        for policy, r in result.items():
            print(f"{entry.label} {entry.kwargs} | {len(entry.groups)} | {entry.max_turns} x "
                  f"{entry.max_actions_per_turn} ({action_budget(entry)}) | {policy} | {r['expected']:.1%} | "
                  f"{r['played']:.1%}")


if __name__ == "__main__":
    main()
