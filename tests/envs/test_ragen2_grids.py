"""RAGEN-2's additions to the grid games: FrozenLake's success_rate slip and the coordinate observation formats of
Sokoban and FrozenLake (both backends; the C++ env equals its twin).

The expected strings were rendered by RAGEN's own rules (ragen/env/sokoban/utils.py and
ragen/env/frozen_lake/utils.py: collect_entity_coordinates, format_coordinate_render, and the envs'
``_render_text``) at mll-lab-nu/RAGEN commit 20daedc47558e000f7de912b060646bf2e8026bd (April 2026), on the
layouts and player cells below.
"""

import numpy as np
import pytest

import fastpo.envs as envs
from fastpo.envs.rng import STREAM_FROZENLAKE_SLIP, CounterRng

BACKENDS = ["cpp", "python"]
LEFT, DOWN, RIGHT, UP = 1, 2, 3, 4  # FrozenLake ids
FL_MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]
FL_HOLES = "Holes: (1, 1), (1, 3), (2, 3), (3, 0)"

SOKOBAN_LAYOUTS = ["######\n#P_X_#\n#_X√_#\n#_O_O#\n######", "######\n#__X_#\n#SX__#\n#_O_√#\n######"]
SOKOBAN_COORDS = [
    "Board size: 5 rows x 6 cols (zero-indexed).\nTargets: (2, 3), (3, 2), (3, 4)\nBoxes: (1, 3), (2, 2)\n"
    "Boxes on target: (2, 3)\nPlayer: (1, 1)",
    "Board size: 5 rows x 6 cols (zero-indexed).\nTargets: (2, 1), (3, 2), (3, 4)\nBoxes: (1, 3), (2, 2)\n"
    "Boxes on target: (3, 4)\nPlayer on target: (2, 1)",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sokoban_coordinate_formats_equal_ragens(backend):
    coord = envs.make("sokoban", 2, backend=backend, dim_room=(5, 6), observation_format="coord")
    assert coord.reset_from_layouts(SOKOBAN_LAYOUTS) == SOKOBAN_COORDS
    both = envs.make("sokoban", 2, backend=backend, dim_room=(5, 6), observation_format="grid_coord")
    expected = [f"Coordinates: \n{c}\nGrid Map: \n{g}" for c, g in zip(SOKOBAN_COORDS, SOKOBAN_LAYOUTS, strict=True)]
    assert both.reset_from_layouts(SOKOBAN_LAYOUTS) == expected
    # Down in env 1 moves the player off its target: "Player on target" becomes "Player", the grid follows.
    obs = both.step(np.array([0, 2], dtype=np.int32))[0]
    assert obs[0] == expected[0]
    assert obs[1] == (
        "Coordinates: \nBoard size: 5 rows x 6 cols (zero-indexed).\nTargets: (2, 1), (3, 2), (3, 4)\n"
        "Boxes: (1, 3), (2, 2)\nBoxes on target: (3, 4)\nPlayer: (3, 1)\nGrid Map: \n"
        "######\n#__X_#\n#OX__#\n#PO_√#\n######"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozenlake_coordinate_formats_equal_ragens(backend):
    env = envs.make("frozenlake", 2, backend=backend, is_slippery=False, observation_format="coord")
    obs = env.reset_from_layouts([FL_MAP, ["FFFF", "FFFF", "FFFF", "FFSG"]])
    head = "Board size: 4 rows x 4 cols (zero-indexed).\n"
    assert obs == [f"{head}Start: (0, 0)\nGoal: (3, 3)\nPlayer: (0, 0)\n{FL_HOLES}",
                   f"{head}Start: (3, 2)\nGoal: (3, 3)\nPlayer: (3, 2)"]
    obs = env.step(np.array([RIGHT, RIGHT], dtype=np.int32))[0]
    assert obs == [f"{head}Start: (0, 0)\nGoal: (3, 3)\nPlayer: (0, 1)\n{FL_HOLES}",
                   f"{head}Start: (3, 2)\nGoal: (3, 3)\nPlayer on goal: (3, 3)"]
    obs = env.step(np.array([DOWN, 0], dtype=np.int32))[0]
    assert obs[0] == f"{head}Start: (0, 0)\nGoal: (3, 3)\nPlayer in hole: (1, 1)\n{FL_HOLES}"
    both = envs.make("frozenlake", 2, backend=backend, is_slippery=False, observation_format="grid_coord")
    both.reset_from_layouts([FL_MAP, ["FFFF", "FFFF", "FFFF", "FFSG"]])
    obs = both.step(np.array([RIGHT, RIGHT], dtype=np.int32))[0]
    assert obs == [
        f"Coordinates: \n{head}Start: (0, 0)\nGoal: (3, 3)\nPlayer: (0, 1)\n{FL_HOLES}\nGrid Map: \n"
        "_P__\n_O_O\n___O\nO__G",
        f"Coordinates: \n{head}Start: (3, 2)\nGoal: (3, 3)\nPlayer on goal: (3, 3)\nGrid Map: \n____\n____\n____\n___√",
    ]


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_bad_observation_format_is_one_line(name):
    with pytest.raises(ValueError, match=r"^observation_format must be one of \['coord', 'grid', 'grid_coord'\], "
                                         r"got 'coords'$"):
        envs.make(name, 1, observation_format="coords")


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan"), "0.8", True])
def test_bad_success_rate_is_one_line(value):
    with pytest.raises(ValueError, match=r"^success_rate must be (in|a number in) \[0.0, 1.0\], got ") as err:
        envs.make("frozenlake", 1, success_rate=value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_success_rate_slip_follows_the_documented_draws(backend):
    """k = gym's categorical_sample over [f, p, f], f = (1 - p) / 2, from one uniform draw of the slip stream."""
    seed, p = 77, 0.55
    env = envs.make("frozenlake", 1, backend=backend, size=8, max_steps=100, success_rate=p)
    open_map = ["F" * 8] * 3 + ["FFFSFFFF"] + ["F" * 8] * 3 + ["FFFFFFFG"]
    env.reset_from_layouts([open_map], seeds=[seed])
    slip = CounterRng(seed, STREAM_FROZENLAKE_SLIP)
    moves = ((0, -1), (1, 0), (0, 1), (-1, 0))
    row, col = 3, 3
    for action in [DOWN, UP, LEFT, RIGHT, UP, UP, LEFT, DOWN, RIGHT, RIGHT]:
        u, f = slip.uniform(), (1 - p) / 2
        gym = action - 1
        gym = [(gym - 1) % 4, gym, (gym + 1) % 4][0 if u < f else 1 if u < f + p else 2]
        row, col = min(max(row + moves[gym][0], 0), 7), min(max(col + moves[gym][1], 0), 7)
        env.step(np.array([action], dtype=np.int32))
        assert env.get_state()["position"].tolist() == [row * 8 + col]
    assert env.get_state()["slip_draws"].tolist() == [10]


@pytest.mark.parametrize("success_rate,expected", [(0.8, (0.1, 0.8, 0.1)), (1.0, (0.0, 1.0, 0.0)),
                                                   (0.0, (0.5, 0.0, 0.5))])
def test_success_rate_frequencies(success_rate, expected):
    """30,000 slippery moves from open ice: RAGEN-2's rule (gymnasium's FrozenLake with success_rate) sends the
    intended move w.p. success_rate and each perpendicular one w.p. (1 - success_rate) / 2 (3 sigma each)."""
    n, steps, size = 3000, 10, 32
    env = envs.make("frozenlake", n, backend="cpp", size=size, max_steps=steps, success_rate=success_rate)
    grid = ["F" * size] * size
    grid[16] = "F" * 16 + "S" + "F" * 15
    grid[-1] = "F" * (size - 1) + "G"
    env.reset_from_layouts([grid] * n, seeds=np.arange(n) + 20_000)
    rng = np.random.default_rng(1)
    counts = np.zeros(3)  # (a - 1) % 4, a, (a + 1) % 4 in gym's order
    deltas = {(0, -1): 0, (1, 0): 1, (0, 1): 2, (-1, 0): 3}
    for _ in range(steps):
        before = env.get_state()["position"]
        actions = rng.integers(1, 5, n).astype(np.int32)
        env.step(actions, render=False)
        after = env.get_state()["position"]
        for b, a, act in zip(before, after, actions, strict=True):
            gym = deltas[(a // size - b // size, a % size - b % size)]
            counts[[(act - 2) % 4, act - 1, act % 4].index(gym)] += 1
    total = n * steps
    assert counts.sum() == total
    freq, expected = counts / total, np.array(expected)
    sigma = np.sqrt(expected * (1 - expected) / total)
    assert np.all(np.abs(freq - expected) <= 3 * sigma), freq


def test_default_slip_is_unchanged():
    """success_rate None keeps gym's slip and its stream exactly (the runs of earlier versions replay)."""
    a = envs.make("frozenlake", 64, backend="cpp", size=8, max_steps=30)
    b = envs.make("frozenlake", 64, backend="python", size=8, max_steps=30, success_rate=None)
    assert a.reset(np.arange(64)) == b.reset(np.arange(64))
    rng = np.random.default_rng(5)
    for _ in range(20):
        actions = rng.integers(0, 6, 64).astype(np.int32)
        assert a.step(actions)[0] == b.step(actions)[0]
    assert np.array_equal(a.get_state()["slip_draws"], b.get_state()["slip_draws"])


@pytest.mark.parametrize("name,cfg", [
    ("sokoban", {"observation_format": "coord"}),
    ("sokoban", {"observation_format": "grid_coord", "dim_room": (7, 7), "num_boxes": 2, "search_depth": 20}),
    ("sokoban", {"observation_format": "grid_coord", "symbols": "different"}),
    ("frozenlake", {"observation_format": "grid_coord", "success_rate": 0.8}),
    ("frozenlake", {"observation_format": "coord", "size": 6, "success_rate": 0.3, "max_steps": 20}),
    ("frozenlake", {"success_rate": 0.0, "num_threads": 2}),
])
def test_twins_equal_on_random_sequences(name, cfg):
    from test_cpp_vs_python import run_pair

    assert run_pair(name, cfg, num_envs=40, rounds=2, steps=12, seed=11) >= 80
