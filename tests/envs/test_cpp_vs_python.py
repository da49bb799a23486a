"""The C++ envs equal their pure-Python twins exactly, and a level depends only on (seed, config)."""

import numpy as np
import pytest

import fastpo.envs as envs
from fastpo import _C
from fastpo.envs.py_frozenlake import generate_random_map
from fastpo.envs.py_sokoban import generate_level

SOKOBAN_CONFIGS = [
    {"dim_room": (6, 6), "num_boxes": 1, "search_depth": 300},  # SimpleSokoban
    {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10},  # LargerSokoban
]


def sokoban_args(cfg):
    return cfg["dim_room"], cfg["num_boxes"], cfg["search_depth"]


@pytest.mark.parametrize("cfg", SOKOBAN_CONFIGS, ids=["6x6", "8x8"])
def test_sokoban_levels_equal_for_2000_seeds(cfg):
    seeds = np.arange(2000, dtype=np.int64) * 104729 - 50_000_000  # negative seeds too
    env = envs.make("sokoban", len(seeds), backend="cpp", num_threads=2, **cfg)
    env.reset(seeds)
    state = env.get_state()
    retried = 0
    for i, seed in enumerate(seeds.tolist()):
        fixed, room, attempt = generate_level(seed, *sokoban_args(cfg))
        assert np.array_equal(state["room_fixed"][i], fixed), seed
        assert np.array_equal(state["room_state"][i], room), seed
        c_fixed, c_room, c_attempt = _C.generate_sokoban(seed, *cfg["dim_room"], cfg["num_boxes"], cfg["search_depth"])
        assert c_attempt == attempt and np.array_equal(c_fixed, fixed) and np.array_equal(c_room, room)
        retried += attempt > 0
    if cfg["num_boxes"] == 2:
        assert retried > 0  # the retry path (attempt >= 1) is exercised and equal too


@pytest.mark.parametrize("size", [4, 8])
def test_frozenlake_maps_equal_for_2000_seeds(size):
    seeds = np.arange(2000, dtype=np.int64) * 7 - 3000
    env = envs.make("frozenlake", len(seeds), backend="cpp", size=size)
    env.reset(seeds)
    state = env.get_state()
    for i, seed in enumerate(seeds.tolist()):
        rows = generate_random_map(seed, size, 0.8)
        assert ["".join(map(chr, r)) for r in state["desc"][i]] == rows, seed
        assert state["position"][i] == "".join(rows).index("S")


def run_pair(name, cfg, num_envs, rounds, steps, seed):
    """Random episodes on both backends; every output and the full state must be identical. Returns the
    number of action sequences (episodes) compared."""
    cpp = envs.make(name, num_envs, backend="cpp", **cfg)
    py = envs.make(name, num_envs, backend="python", **cfg)
    rng = np.random.default_rng(seed)
    sequences = 0
    for _ in range(rounds):
        seeds = rng.integers(-(2**62), 2**62, num_envs)
        assert cpp.reset(seeds) == py.reset(seeds)
        sequences += num_envs
        assert np.array_equal(cpp.state_keys(), py.state_keys())
        for t in range(steps):
            actions = rng.integers(-2, 7, num_envs).astype(np.int32)  # 0, negatives and > 4 included
            out_c, out_p = cpp.step(actions), py.step(actions)
            assert out_c[0] == out_p[0]
            for k in (1, 2, 3):
                assert out_c[k].dtype == out_p[k].dtype and np.array_equal(out_c[k], out_p[k])
            for key in out_p[4]:
                assert np.array_equal(out_c[4][key], out_p[4][key]), key
            keys = cpp.state_keys()
            assert keys.dtype == np.uint64 and np.array_equal(keys, py.state_keys())
            if t == steps // 2:  # restart a random subset mid-episode
                mask = rng.random(num_envs) < 0.3
                new = rng.integers(0, 10**6, num_envs)
                assert cpp.reset(new, mask) == py.reset(new, mask)
                sequences += int(mask.sum())
        state_c, state_p = cpp.get_state(), py.get_state()
        assert state_c.keys() == state_p.keys()
        for key in state_p:
            assert state_c[key].dtype == state_p[key].dtype and np.array_equal(state_c[key], state_p[key]), key
    return sequences


@pytest.mark.slow
def test_random_action_sequences_equal():
    """More than 10,000 random action sequences over Sokoban and (slippery) FrozenLake configurations, the
    coordinate observation formats and the success_rate slip included."""
    cases = [
        ("sokoban", {"max_steps": 10}, 12),
        ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10, "symbols": "different"}, 14),
        ("sokoban", {"dim_room": (7, 5), "num_boxes": 2, "max_steps": 6, "num_threads": 2}, 8),
        ("frozenlake", {"size": 4}, 12),
        ("frozenlake", {"size": 8, "max_steps": 20, "num_threads": 2}, 22),
        ("frozenlake", {"size": 4, "is_slippery": False, "p": 0.6}, 12),
        ("sokoban", {"observation_format": "grid_coord", "max_steps": 10}, 12),
        ("frozenlake", {"size": 6, "success_rate": 0.8, "observation_format": "grid_coord", "max_steps": 15}, 16),
    ]
    total = 0
    for k, (name, cfg, steps) in enumerate(cases):
        total += run_pair(name, cfg, num_envs=200, rounds=8, steps=steps, seed=k)
    assert total >= 10_000


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_state_keys_identify_exact_states(name):
    """Equal keys <=> equal (map, dynamic state) over many random states; a state reached again (a move and its
    reverse, or after a different step count) gets its earlier key back."""
    cfg = {"is_slippery": False} if name == "frozenlake" else {}
    env = envs.make(name, 400, backend="cpp", **cfg)
    rng = np.random.default_rng(3)
    env.reset(rng.integers(0, 8, 400))  # 8 levels: many instances share a level
    seen = {}
    for _ in range(6):
        state = env.get_state()
        parts = ("room_fixed", "room_state") if name == "sokoban" else ("desc", "position")
        for i, key in enumerate(env.state_keys().tolist()):
            exact = b"".join(np.ascontiguousarray(state[p][i]).tobytes() for p in parts)
            assert seen.setdefault(key, exact) == exact  # one state per key
        env.step(rng.integers(1, 5, 400).astype(np.int32), render=False)
    assert len(set(seen.values())) == len(seen) > 50  # and one key per state
    # back and forth on one instance: Sokoban 3 Left / 4 Right, FrozenLake 1 Left / 3 Right
    one = envs.make(name, 1, backend="cpp", **cfg)
    sokoban = ["######", "#____#", "#_P__#", "#_X_O#", "#____#", "######"]
    layout = sokoban if name == "sokoban" else ["FFFF", "FSFF", "FFFF", "HFFG"]
    one.reset_from_layouts([layout])
    start = one.state_keys()[0]
    back, forth = (3, 4) if name == "sokoban" else (1, 3)
    one.step(np.array([back], np.int32))
    moved = one.state_keys()[0]
    one.step(np.array([forth], np.int32))
    assert moved != start and one.state_keys()[0] == start


def test_layout_episodes_equal():
    layouts = ["######\n#P_X_#\n#_X√_#\n#_O_O#\n######", "######\n#__X_#\n#SX__#\n#_O__#\n######"] * 4
    rng = np.random.default_rng(1)
    cpp = envs.make("sokoban", 8, backend="cpp", dim_room=(5, 6), max_steps=30)
    py = envs.make("sokoban", 8, backend="python", dim_room=(5, 6), max_steps=30)
    assert cpp.reset_from_layouts(layouts) == py.reset_from_layouts(layouts)
    for _ in range(40):
        actions = rng.integers(0, 5, 8).astype(np.int32)
        a, b = cpp.step(actions), py.step(actions)
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
    maps = [["SFFF", "FHFH", "FFFH", "HFFG"]] * 8
    cpp = envs.make("frozenlake", 8, backend="cpp", max_steps=30)
    py = envs.make("frozenlake", 8, backend="python", max_steps=30)
    assert cpp.reset_from_layouts(maps, seeds=np.arange(8)) == py.reset_from_layouts(maps, seeds=np.arange(8))
    for _ in range(40):
        actions = rng.integers(0, 5, 8).astype(np.int32)
        a, b = cpp.step(actions), py.step(actions)
        assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


@pytest.mark.parametrize(
    "name,cfg",
    [("sokoban", {}), ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}), ("frozenlake", {})],
)
def test_level_depends_only_on_seed_and_config(name, cfg):
    seeds = np.arange(64, dtype=np.int64) * 31337 + 5
    actions = np.random.default_rng(0).integers(1, 5, (6, 64)).astype(np.int32)

    def episode(num_threads, idx):
        """Run instances `idx` of the seed list in a batch of len(idx); returns per-seed (obs, state)."""
        env = envs.make(name, len(idx), backend="cpp", num_threads=num_threads, **cfg)
        obs = [env.reset(seeds[idx])]
        for t in range(actions.shape[0]):
            obs.append(env.step(actions[t, idx])[0])
        state = env.get_state()
        return {int(j): ([o[k] for o in obs], {key: v[k] for key, v in state.items()}) for k, j in enumerate(idx)}

    reference = episode(1, np.arange(64))
    order = np.random.default_rng(1).permutation(64)
    runs = [episode(2, np.arange(64)), episode(2, order)]
    runs += [episode(1, order[i : i + 7]) for i in range(0, 63, 7)]
    runs += [episode(1, np.array([j])) for j in (0, 17, 63)]
    for run in runs:
        for j, (obs, state) in run.items():
            assert obs == reference[j][0]
            for key in state:
                assert np.array_equal(state[key], reference[j][1][key]), (j, key)


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_mask_reset_leaves_other_instances_untouched(name):
    env = envs.make(name, 16, backend="cpp", num_threads=2)
    env.reset(np.arange(16))
    env.step(np.full(16, 2, dtype=np.int32))
    before = env.get_state()
    obs_before = env.render()
    mask = np.zeros(16, dtype=bool)
    mask[[1, 5, 6]] = True
    obs = env.reset(np.arange(16) + 1000, mask)
    after = env.get_state()
    fresh = envs.make(name, 16, backend="cpp")
    fresh_obs = fresh.reset(np.arange(16) + 1000)
    fresh_state = fresh.get_state()
    for i in range(16):
        if mask[i]:
            assert obs[i] == fresh_obs[i]
            assert all(np.array_equal(after[k][i], fresh_state[k][i]) for k in after)
        else:
            assert obs[i] == obs_before[i]
            assert all(np.array_equal(after[k][i], before[k][i]) for k in after)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SOKOBAN_CONFIGS, ids=["6x6", "8x8"])
def test_sokoban_levels_equal_for_5000_seeds_over_the_int64_range(cfg):
    """5,000 random seeds over the whole int64 range (the fast test above covers 2,000 structured ones). It was
    20,000, the slowest test of the suite (86 s on 2 cores): the generator has not differed since."""
    seeds = np.random.default_rng(7).integers(-(2**63), 2**63 - 1, 5_000)
    env = envs.make("sokoban", len(seeds), backend="cpp", num_threads=2, **cfg)
    env.reset(seeds)
    state = env.get_state()
    for i, seed in enumerate(seeds.tolist()):
        fixed, room, _ = generate_level(seed, *sokoban_args(cfg))
        assert np.array_equal(state["room_fixed"][i], fixed) and np.array_equal(state["room_state"][i], room), seed


@pytest.mark.slow
def test_sokoban_large_rooms_equal_including_the_explored_cap():
    """Bigger rooms reach RAGEN's 300,000 explored-states cap; the C++ DFS must stop at the same state."""
    from fastpo.envs import py_sokoban

    largest = []
    run = py_sokoban.ReversePlay.run

    def counting_run(self, room_state):
        result = run(self, room_state)
        largest.append(len(self.explored))
        return result

    py_sokoban.ReversePlay.run = counting_run
    try:
        # 12x12 seed 7 is the one of seeds 0-7 that reaches the cap; seeds 2, 3 and 5 search 40-275K states without
        # reaching it and cost ~60% of the test's time, so they are left out
        for dim, boxes, depth, seeds in [((10, 10), 3, 300, range(10)), ((12, 12), 4, 300, (0, 1, 4, 6, 7))]:
            for seed in seeds:
                fixed, room, attempt = generate_level(seed, dim, boxes, depth)
                c_fixed, c_room, c_attempt = _C.generate_sokoban(seed, *dim, boxes, depth)
                assert c_attempt == attempt and np.array_equal(c_fixed, fixed) and np.array_equal(c_room, room)
    finally:
        py_sokoban.ReversePlay.run = run
    assert max(largest) == py_sokoban.MAX_EXPLORED_STATES
