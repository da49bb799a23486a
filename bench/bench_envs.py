"""Environment throughput: the C++ batch simulator (fastpo._C) vs its pure-Python twin, side by side.

    OMP_NUM_THREADS=1 python bench/bench_envs.py            # full table (a few minutes on 2 cores)
    python bench/bench_envs.py --quick                      # small sizes, for a smoke run
    OMP_NUM_THREADS=1 python bench/bench_envs.py --envs game2048-4x4 sudoku-9x9 rubiks-2x2 --sizes 64 1024 \
        --threads 1 2 --note "machine loaded"              # the RAGEN-2 games only, with a note in each row

Measured per (env, backend, N, threads): env steps/s without rendering, env steps/s with the text render
of every observation, Sokoban level generations/s, and resets/s of the RAGEN-2 games (2048, Sudoku, the 2x2
cube). Steps use random valid ids (Sudoku: random placements in RAGEN's text formats); instances that finish are
re-generated between timed calls (untimed), so every timed step is a real step, never a no-op on a finished
episode; each step's results are kept until the next step has returned, as a rollout keeps its observations.
Each figure is the median (p20, p80) over repeats. Rows go to bench/results/envs.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_allow_dirty, append_rows, quantiles, require_clean_tree  # noqa: E402

import fastpo.envs  # noqa: E402

NO_BUDGET = 1 << 30  # max_steps large enough that no instance is truncated during a timed run

CONFIGS = {
    "sokoban-6x6": ("sokoban", {"dim_room": (6, 6), "num_boxes": 1, "search_depth": 300}),
    "sokoban-8x8": ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}),
    "frozenlake-4x4": ("frozenlake", {"size": 4, "p": 0.8, "is_slippery": True}),
    # RAGEN-2: CoordSokoban's observations, FrozenLake's success_rate slip, 2048.
    "sokoban-6x6-coord": ("sokoban", {"dim_room": (6, 6), "num_boxes": 1, "observation_format": "grid_coord"}),
    "frozenlake-4x4-coord": ("frozenlake", {"size": 4, "success_rate": 0.8, "observation_format": "grid_coord"}),
    "game2048-4x4": ("game_2048", {"size": 4}),
    "sudoku-9x9": ("sudoku", {"grid_size": 9, "difficulty": "easy", "render_format": "with_feedback"}),
    "rubiks-2x2": ("rubikscube", {"scramble_depth": 5}),
}
#: Envs whose reset (a new episode) is timed as "reset" (Sokoban's is its level generation, "generate").
RESET_TIMED = ("game2048-4x4", "sudoku-9x9", "rubiks-2x2")
#: Text actions of the text envs (Sudoku): RAGEN's two formats over every cell and number, drawn at random.
TEXT_ACTIONS = [f"{r},{c},{v}" for r in range(1, 10) for c in range(1, 10) for v in range(1, 10)] + [
    f"place {v} at row {r} col {c}" for r in range(1, 10) for c in range(1, 10) for v in range(1, 10)]


def make(env_key: str, backend: str, n: int, threads: int):
    name, cfg = CONFIGS[env_key]
    extra = {"num_threads": threads} if backend == "cpp" else {}
    return fastpo.envs.make(name, n, backend=backend, max_steps=NO_BUDGET, **cfg, **extra)


def time_steps(env, n: int, steps: int, render: bool, rng: np.random.Generator) -> float:
    """Seconds per batched step call over ``steps`` calls (finished instances reset untimed)."""
    seed_base = 1_000_000
    env.reset(np.arange(seed_base, seed_base + n, dtype=np.int64))
    elapsed = 0.0
    text = env.action_space == "text"
    top = len(env.action_names) + 1  # ids 1..number of actions (4 for the grid games, 12 for the cube)
    for k in range(steps):
        if text:
            actions = [TEXT_ACTIONS[j] for j in rng.integers(0, len(TEXT_ACTIONS), size=n)]
        else:
            actions = rng.integers(1, top, size=n, dtype=np.int32)
        t0 = time.perf_counter()
        # The previous step's results stay alive until this call has returned, as in a rollout (it reads the
        # observations to build the next prompts). Dropping them first would hand their memory back to the OS
        # (glibc trims the heap top), and every step would pay page faults for new observation strings.
        result = env.step(actions, render=render)
        elapsed += time.perf_counter() - t0
        _, _, terminated, truncated, _ = result
        done = terminated | truncated
        if done.any():
            seeds = np.arange(n, dtype=np.int64) + seed_base + (k + 1) * n
            env.reset(seeds, mask=done)
    return elapsed / steps


def time_generation(env, n: int, rep: int) -> float:
    seeds = np.arange(n, dtype=np.int64) + 10_000_000 * (rep + 1)
    t0 = time.perf_counter()
    env.reset(seeds)
    return time.perf_counter() - t0


def run(args) -> list[dict]:
    rows, table = [], []
    rng = np.random.default_rng(0)
    for env_key in args.envs:
        for n in args.sizes:
            for backend, threads in [("cpp", t) for t in args.threads] + [("python", 1)]:
                if backend == "python" and n > args.max_python_n:
                    continue
                env = make(env_key, backend, n, threads)
                # Enough calls that the fastest case still runs for a measurable time.
                budget = 200_000 if backend == "cpp" else 20_000
                steps = max(5 if backend == "cpp" else 3, min(args.steps, budget // n))
                results = {}
                for mode, render in (("step", False), ("step+render", True)):
                    per_call = [time_steps(env, n, steps, render, rng) for _ in range(args.repeats)]
                    results[mode] = quantiles([n / t for t in per_call])
                if env_key.startswith("sokoban") or env_key in RESET_TIMED:
                    gen_n = n if backend == "cpp" else min(n, args.max_python_gen)
                    gen_env = env if gen_n == n else make(env_key, backend, gen_n, threads)
                    per_call = [time_generation(gen_env, gen_n, r) for r in range(args.repeats)]
                    results["generate" if env_key.startswith("sokoban") else "reset"] = quantiles(
                        [gen_n / t for t in per_call])
                cfg = f"{CONFIGS[env_key][1]} threads={threads} steps/rep={steps} repeats={args.repeats}"
                if args.note:
                    cfg += f" note={args.note}"
                for mode, (p50, p20, p80) in results.items():
                    metric = {"generate": "levels_per_s", "reset": "resets_per_s"}.get(mode, "env_steps_per_s")
                    rows.append(dict(name=env_key, provider=backend, mode=mode, metric=metric, unit="1/s",
                                     x_name="num_envs", x_value=n, p50=p50, p20=p20, p80=p80,
                                     config=cfg.replace(",", ";")))
                    table.append((env_key, backend, threads, n, mode, p50))
                print(f"{env_key:20s} {backend:6s} threads={threads} N={n:5d} " +
                      "  ".join(f"{m}={v[0]:,.0f}/s" for m, v in results.items()), flush=True)
    return rows, table


def print_speedups(table) -> None:
    """C++ (per thread count) over the Python twin at the same N and mode."""
    py = {(e, n, m): v for e, b, _, n, m, v in table if b == "python"}
    print("\nspeedup of C++ over the Python twin (median throughput ratio)")
    print(f"{'env':20s} {'threads':>7s} {'N':>6s} {'step':>9s} {'step+render':>12s} {'generate':>9s} {'reset':>9s}")
    keys = sorted({(e, t, n) for e, b, t, n, _, _ in table if b == "cpp"})
    for e, t, n in keys:
        cells = []
        for m in ("step", "step+render", "generate", "reset"):
            c = next((v for e2, b, t2, n2, m2, v in table if (e2, b, t2, n2, m2) == (e, "cpp", t, n, m)), None)
            p = py.get((e, n, m))
            cells.append(f"{c / p:,.0f}x" if c and p else "-")
        print(f"{e:20s} {t:7d} {n:6d} {cells[0]:>9s} {cells[1]:>12s} {cells[2]:>9s} {cells[3]:>9s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 64, 1024, 8192])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=50, help="timed step calls per repeat (upper bound)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-python-n", type=int, default=1024, help="largest N run on the Python twin")
    parser.add_argument("--max-python-gen", type=int, default=1024, help="levels generated per Python repeat")
    parser.add_argument("--quick", action="store_true", help="small sizes and repeats (smoke run)")
    parser.add_argument("--note", default="", help="context stamped into each row's config column, e.g. 'machine "
                        "loaded by other jobs' (compare only the C++ / twin ratios of such a run)")
    parser.add_argument("--no-save", action="store_true", help="print only, append nothing to bench/results")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if not args.no_save:
        require_clean_tree(args.allow_dirty)
    if args.quick:
        args.sizes, args.repeats, args.steps, args.max_python_gen = [1, 64], 2, 5, 16
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, table = run(args)
    print_speedups(table)
    if not args.no_save:
        path = append_rows("envs", rows)
        print(f"\nappended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
