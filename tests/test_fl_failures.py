"""bench/fl_failures.py: the detour / direct split of FrozenLake levels, and subset evaluations that are exactly
the full evaluation's episodes."""

import json
from pathlib import Path

import numpy as np
import pytest

from fastpo.config import to_json
from fastpo.presets import get_preset

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def fl_failures(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import fl_failures

    return fl_failures


def _desc(rows):
    return np.array([[ord(c) for c in row] for row in rows], dtype=np.uint8)


def test_level_kind_by_hand(fl_failures):
    # a hole between start and goal in the top row: down, right, right, up (4) > Manhattan 2
    assert fl_failures.level_kind(_desc(["SHGF", "FFFF", "FFFF", "FFFF"]), 0) == "detour"
    # a hole on one straight route but not the other: still Manhattan-short
    assert fl_failures.level_kind(_desc(["SHFF", "FFFF", "FFGF", "FFFF"]), 0) == "direct"
    # no safe path at all counts as direct (there is no detour to take)
    assert fl_failures.level_kind(_desc(["SHFF", "HGFF", "FFFF", "FFFF"]), 0) == "direct"
    # holes on both L-shaped routes of length 2 from the player at cell 5; the way around is 6 long
    assert fl_failures.level_kind(_desc(["FFFF", "FSHF", "FHGF", "FFFF"]), 5) == "detour"


def test_split_matches_an_independent_bfs(fl_failures):
    seeds = list(range(123, 123 + 64))
    parts = fl_failures.split_levels("frozenlake", seeds, {"is_slippery": False})
    assert sorted(parts["direct"] + parts["detour"]) == seeds
    from fastpo import envs

    env = envs.make("frozenlake", len(seeds), is_slippery=False)
    env.reset(np.asarray(seeds))
    state = env.get_state()
    for seed, desc, pos in zip(seeds, state["desc"], state["position"], strict=True):
        grid = [[chr(c) for c in row] for row in desc]
        size = len(grid)
        start, goal = divmod(int(pos), size), divmod(int(np.flatnonzero(desc.reshape(-1) == ord("G"))[0]), size)
        dist, frontier = {start: 0}, [start]
        while frontier:  # breadth-first over safe cells
            nxt = []
            for r, c in frontier:
                for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                    if 0 <= rr < size and 0 <= cc < size and (rr, cc) not in dist and grid[rr][cc] != "H":
                        dist[rr, cc] = dist[r, c] + 1
                        nxt.append((rr, cc))
            frontier = nxt
        manhattan = abs(start[0] - goal[0]) + abs(start[1] - goal[1])
        expect = "detour" if goal in dist and dist[goal] > manhattan else "direct"
        assert seed in parts[expect]


def test_parts_are_the_full_evaluation(fl_failures, tmp_path):
    from fastpo import eval as fe
    from fastpo.tiny_agent import tiny_agent_path

    cfg = json.loads(to_json(get_preset("tiny")))
    cfg["env"]["val_groups"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = str(tiny_agent_path(build_if_missing=False))
    row = fl_failures.by_level(str(tmp_path / "config.json"), model)
    assert row["direct"][1] + row["detour"][1] == row["all"][1] == 48
    args = fe.parse_args(["--config", str(tmp_path / "config.json"), "--model.path", model])
    entries, tok, policy, _ = fe.prepare(args)
    full = fe.evaluate_entry(args, policy, tok, entries[0])["success"]
    assert row["all"][0] == pytest.approx(full, abs=1e-9)
