"""FrozenLake rules on hand-written maps (both backends), renders, slip statistics, map generation, solver."""

import numpy as np
import pytest

import fastpo.envs as envs
from fastpo import _C
from fastpo.envs.py_frozenlake import generate_random_map
from fastpo.envs.rng import STREAM_FROZENLAKE_SLIP, CounterRng
from fastpo.envs.solvers import solve_frozenlake

BACKENDS = ["cpp", "python"]
LEFT, DOWN, RIGHT, UP = 1, 2, 3, 4
MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]


def make(backend, num_envs=1, **cfg):
    return envs.make("frozenlake", num_envs, backend=backend, **cfg)


def step(env, actions):
    obs, reward, terminated, truncated, info = env.step(np.asarray(actions, dtype=np.int32))
    return obs, reward, terminated, truncated, info["success"], info["action_is_valid"], info["action_is_effective"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_renders_hole_and_goal(backend):
    env = make(backend, 2, is_slippery=False)
    obs = env.reset_from_layouts([MAP, "FFFF\nFFFF\nFFFF\nFFSG"])
    assert obs == ["P___\n_O_O\n___O\nO__G", "____\n____\n____\n__PG"]
    obs, reward, term, trunc, success, valid, effective = step(env, [RIGHT, RIGHT])
    assert obs == ["_P__\n_O_O\n___O\nO__G", "____\n____\n____\n___√"]
    assert reward.tolist() == [0.0, 1.0] and term.tolist() == [False, True] and success.tolist() == [False, True]
    obs, reward, term, trunc, success, valid, effective = step(env, [DOWN, DOWN])
    assert obs == ["____\n_X_O\n___O\nO__G", "____\n____\n____\n___√"]
    assert reward.tolist() == [0.0, 0.0] and term.tolist() == [True, True] and success.tolist() == [False, True]
    assert valid.tolist() == [True, False] and effective.tolist() == [True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_walls_invalid_ids_budget_and_finished(backend):
    env = make(backend, 1, is_slippery=False, max_steps=3)
    env.reset_from_layouts([MAP])
    obs, reward, term, trunc, success, valid, effective = step(env, [UP])  # off the map: stays, costs a step
    assert obs[0].startswith("P") and valid[0] and not effective[0] and reward[0] == 0.0
    for bad in (0, -1, 5, 99):
        obs, reward, term, trunc, success, valid, effective = step(env, [bad])
        assert not valid[0] and not effective[0] and not term[0] and not trunc[0]
    assert env.get_state()["num_steps"].tolist() == [1]
    step(env, [RIGHT])
    obs, reward, term, trunc, success, valid, effective = step(env, [RIGHT])
    assert trunc[0] and not term[0] and obs[0].startswith("__P_")
    obs2, reward, term, trunc, success, valid, effective = step(env, [RIGHT])
    assert obs2 == obs and trunc[0] and not valid[0] and reward[0] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_slip_follows_the_documented_draws(backend):
    """Gym direction = [(a - 1) % 4, a, (a + 1) % 4][randint(3)] on the slip stream of the reset seed."""
    seed = 123
    env = make(backend, 1, size=8, max_steps=100)
    open_map = ["F" * 8] * 3 + ["FFFSFFFF"] + ["F" * 8] * 3 + ["FFFFFFFG"]
    env.reset_from_layouts([open_map], seeds=[seed])
    slip = CounterRng(seed, STREAM_FROZENLAKE_SLIP)
    moves = ((0, -1), (1, 0), (0, 1), (-1, 0))
    row, col = 3, 3
    for action in [DOWN, UP, LEFT, RIGHT, UP, UP, LEFT, DOWN]:
        gym = action - 1
        gym = [(gym - 1) % 4, gym, (gym + 1) % 4][slip.randint(3)]
        row, col = min(max(row + moves[gym][0], 0), 7), min(max(col + moves[gym][1], 0), 7)
        step(env, [action])
        assert env.get_state()["position"].tolist() == [row * 8 + col]
    assert env.get_state()["slip_draws"].tolist() == [8]


def test_slip_frequencies_are_one_third():
    """30,000 slippery moves from open ice: intended and each perpendicular direction w.p. 1/3 (3 sigma)."""
    n, steps, size = 3000, 10, 32
    env = make("cpp", n, size=size, max_steps=steps)
    grid = ["F" * size] * size
    grid[16] = "F" * 16 + "S" + "F" * 15
    grid[-1] = "F" * (size - 1) + "G"
    env.reset_from_layouts([grid] * n, seeds=np.arange(n) + 10_000)
    rng = np.random.default_rng(0)
    counts = np.zeros(3)  # perpendicular-left (a-1), intended, perpendicular-right (a+1), in gym order
    deltas = {(0, -1): 0, (1, 0): 1, (0, 1): 2, (-1, 0): 3}
    for _ in range(steps):
        before = env.get_state()["position"]
        actions = rng.integers(1, 5, n).astype(np.int32)
        env.step(actions)
        after = env.get_state()["position"]
        for b, a, act in zip(before, after, actions, strict=True):
            gym = deltas[(a // size - b // size, a % size - b % size)]
            counts[[(act - 2) % 4, act - 1, act % 4].index(gym)] += 1
    total = n * steps
    sigma = np.sqrt((1 / 3) * (2 / 3) / total)
    assert counts.sum() == total
    assert np.all(np.abs(counts / total - 1 / 3) < 3 * sigma), counts / total


def test_generated_maps_are_valid():
    for size in (4, 8):
        holes = 0
        for seed in range(300):
            rows = generate_random_map(seed, size, 0.8)
            text = "".join(rows)
            assert len(rows) == size and all(len(r) == size for r in rows)
            assert text.count("S") == 1 and text.count("G") == 1 and set(text) <= set("SFHG")
            desc = np.frombuffer(text.encode(), dtype=np.uint8).reshape(size, size)
            assert solve_frozenlake(desc, text.index("S")) is not None  # goal reachable
            holes += text.count("H")
        # Holes w.p. 0.2 per cell (a bit fewer: S/G overwrite, unreachable maps are redrawn).
        assert 0.12 < holes / (300 * size * size) < 0.21
    desc, start = _C.generate_frozenlake(7, 8, 0.8)
    assert ["".join(map(chr, r)) for r in desc] == generate_random_map(7, 8, 0.8) and desc.flat[start] == ord("S")


@pytest.mark.parametrize("backend", BACKENDS)
def test_solver_paths_reach_the_goal(backend):
    env = make(backend, 64, size=8, is_slippery=False, max_steps=100)
    env.reset(np.arange(64))
    solutions = env.solve()
    assert all(s for s in solutions)
    for t in range(max(map(len, solutions))):
        step(env, [s[t] if t < len(s) else 0 for s in solutions])
    state = env.get_state()
    assert state["terminated"].all() and not state["truncated"].any()
    assert (state["desc"].reshape(64, -1)[np.arange(64), state["position"]] == ord("G")).all()


def test_solver_is_shortest_on_hand_maps():
    desc = np.frombuffer("".join(MAP).encode(), dtype=np.uint8).reshape(4, 4)
    assert solve_frozenlake(desc, 0) == [DOWN, DOWN, RIGHT, DOWN, RIGHT, RIGHT]  # Manhattan distance 6
    assert solve_frozenlake(desc, 15) == []
    assert solve_frozenlake(desc, 5) is None  # in a hole
    walled = np.frombuffer(b"SFHFFHFFHHFFFFFG", dtype=np.uint8).reshape(4, 4)
    assert solve_frozenlake(walled, 0) is None
