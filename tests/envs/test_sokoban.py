"""Sokoban rules on hand-written levels (both backends), renders, solver optimality, generated levels."""

import copy
import itertools

import numpy as np
import pytest

import fastpo.envs as envs
from fastpo.envs.layouts import parse_sokoban_layouts
from fastpo.envs.py_sokoban import SokobanGame
from fastpo.envs.solvers import solve_sokoban

BACKENDS = ["cpp", "python"]
UP, DOWN, LEFT, RIGHT = 1, 2, 3, 4


def make(backend, num_envs=1, **cfg):
    return envs.make("sokoban", num_envs, backend=backend, **cfg)


def step1(env, action):
    """Step a 1-instance env; returns (obs, reward, terminated, truncated, success, valid, effective)."""
    obs, reward, terminated, truncated, info = env.step(np.array([action], dtype=np.int32))
    flags = (info["success"][0], info["action_is_valid"][0], info["action_is_effective"][0])
    return (obs[0], reward[0], terminated[0], truncated[0], *flags)


LEVEL = "\n".join(["######", "#P_O_#", "#_X√_#", "#____#", "######"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_render_both_symbol_sets(backend):
    assert make(backend, dim_room=(5, 6)).reset_from_layouts([LEVEL]) == [LEVEL]
    different = make(backend, dim_room=(5, 6), symbols="different").reset_from_layouts([LEVEL])
    assert different == ["WWWWWW\nWA.G.W\nW.BC.W\nW....W\nWWWWWW"]
    on_target = "######\n#S_X_#\n#____#\n#____#\n######"
    assert make(backend, dim_room=(5, 6)).reset_from_layouts([on_target]) == [on_target]
    assert make(backend, dim_room=(5, 6), symbols="different").reset_from_layouts([on_target]) == [
        "WWWWWW\nW@.B.W\nW....W\nW....W\nWWWWWW"
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_onto_target_and_win(backend):
    env = make(backend, dim_room=(5, 6))
    env.reset_from_layouts(["######\n#PX_O#\n#____#\n#____#\n######"])
    obs, reward, term, trunc, success, valid, effective = step1(env, RIGHT)
    assert obs == "######\n#_PXO#\n#____#\n#____#\n######"
    assert reward == np.float32(-0.1) and (term, trunc, success, valid, effective) == (False, False, False, True, True)
    obs, reward, term, trunc, success, valid, effective = step1(env, RIGHT)
    assert obs == "######\n#__P√#\n#____#\n#____#\n######"
    assert reward == np.float32(-0.1 + 1.0 + 10.0)
    assert (term, trunc, success, valid, effective) == (True, False, True, True, True)
    # A finished instance: no-op, reward 0, flags unchanged, not valid.
    obs2, reward, term, trunc, success, valid, effective = step1(env, LEFT)
    assert (
        obs2 == obs and reward == 0.0 and (term, trunc, success, valid, effective) == (True, False, True, False, False)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_push_on_and_off_target_with_two_boxes(backend):
    env = make(backend, dim_room=(5, 6), num_boxes=2)
    env.reset_from_layouts(["######\n#PXO_#\n#__X_#\n#__O_#\n######"])
    _, reward, term, _, success, _, _ = step1(env, RIGHT)  # box onto target, one box left
    assert reward == np.float32(0.9) and not term and not success
    assert env.get_state()["boxes_on_target"].tolist() == [1]
    obs, reward, term, _, _, _, effective = step1(env, RIGHT)  # off the target again
    assert obs == "######\n#__SX#\n#__X_#\n#__O_#\n######"
    assert reward == np.float32(-1.1) and not term and effective
    assert env.get_state()["boxes_on_target"].tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocked_moves_cost_a_step_but_are_not_effective(backend):
    level = "######\n#PX__#\n#XO__#\n#_O__#\n######"
    env = make(backend, dim_room=(5, 6), num_boxes=2, max_steps=50)
    env.reset_from_layouts([level])
    for action in (UP, LEFT):  # into a wall
        obs, reward, term, trunc, success, valid, effective = step1(env, action)
        assert obs == level and reward == np.float32(-0.1) and valid and not effective and not term
    env.reset_from_layouts(["######\n#_PXX#\n#_O__#\n#_O__#\n######"])
    obs, reward, _, _, _, valid, effective = step1(env, RIGHT)  # box into box, then box into wall
    assert obs == "######\n#_PXX#\n#_O__#\n#_O__#\n######" and reward == np.float32(-0.1) and valid and not effective
    assert env.get_state()["num_steps"].tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_edges_block_like_walls(backend):
    # No border walls: moving or pushing off the grid is blocked on all four sides.
    env = make(backend, dim_room=(4, 4), max_steps=50)
    level = "__PX\nO___\n____\n____"
    env.reset_from_layouts([level])
    for action in (UP, RIGHT):
        obs, reward, _, _, _, valid, effective = step1(env, action)
        assert obs == level and reward == np.float32(-0.1) and valid and not effective
    env.reset_from_layouts(["____\n____\n____\nXPO_"])
    for action, expected in ((DOWN, "____\n____\n____\nXPO_"), (LEFT, "____\n____\n____\nXPO_")):
        obs, _, _, _, _, _, effective = step1(env, action)
        assert obs == expected and not effective
    obs, *_ = step1(env, UP)
    assert obs == "____\n____\n_P__\nX_O_"


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_ids_change_nothing_and_do_not_count(backend):
    env = make(backend, dim_room=(5, 6), max_steps=2)
    level = "######\n#P_X_#\n#___O#\n#____#\n######"
    env.reset_from_layouts([level])
    for action in (0, -1, -7, 5, 6, 2**31 - 1):
        obs, reward, term, trunc, success, valid, effective = step1(env, action)
        assert obs == level and reward == 0.0 and (term, trunc, success, valid, effective) == (False,) * 5
    assert env.get_state()["num_steps"].tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_truncation_and_win_on_last_step(backend):
    env = make(backend, dim_room=(5, 6), max_steps=3)
    env.reset_from_layouts(["######\n#P___#\n#____#\n#X__O#\n######"])
    results = [step1(env, a) for a in (RIGHT, LEFT, RIGHT)]
    assert [r[3] for r in results] == [False, False, True] and not any(r[2] for r in results)
    _, reward, term, trunc, _, valid, _ = step1(env, DOWN)
    assert reward == 0.0 and trunc and not term and not valid
    env.reset_from_layouts(["######\n#PX_O#\n#____#\n#____#\n######"])
    step1(env, 0)  # invalid: does not use the budget
    results = [step1(env, a) for a in (UP, RIGHT, RIGHT)]
    assert results[-1][2] and not results[-1][3] and results[-1][4]  # terminated, not truncated, success
    assert results[-1][1] == np.float32(10.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_with_box_on_target_counts_it(backend):
    env = make(backend, dim_room=(5, 6), num_boxes=2)
    env.reset_from_layouts(["######\n#P√__#\n#_X_O#\n#____#\n######"])
    assert env.get_state()["boxes_on_target"].tolist() == [1]
    _, reward, *_ = step1(env, RIGHT)  # pushes the box off its target: RAGEN would not give the -1 here
    assert reward == np.float32(-1.1)


# ------------------------------------------------------------------------------------------- solver

HAND_LEVELS = [
    ("######\n#P___#\n#_X__#\n#__O_#\n#____#\n######", 5),
    ("######\n#____#\n#_X_O#\n#_PX_#\n#__O_#\n######", 5),
    ("######\n#__O_#\n#_X__#\n#P___#\n#____#\n######", 5),
    ("######\n#_P__#\n#_√__#\n#____#\n#____#\n######", 0),
    ("######\n#P___#\n#____#\n#__X_#\n#O___#\n######", 8),
]


def brute_force_optimum(level, max_len):
    """Iterative deepening over all action sequences: the optimal length, or None beyond max_len."""
    fixed, state = parse_sokoban_layouts([level], 1, (6, 6))

    def solvable(game, depth):
        if game.all_boxes_on_target():
            return True
        if depth == 0:
            return False
        for action in (UP, DOWN, LEFT, RIGHT):
            child = copy.deepcopy(game)
            child.step(action)
            if child.player != game.player and solvable(child, depth - 1):
                return True
        return False

    for length in range(max_len + 1):
        if solvable(SokobanGame(fixed[0], state[0], 1000), length):
            return length
    return None


@pytest.mark.parametrize("level,known", HAND_LEVELS)
def test_bfs_length_equals_brute_force(level, known):
    fixed, state = parse_sokoban_layouts([level], 1, (6, 6))
    solution = solve_sokoban(fixed[0], state[0], max_depth=30)
    assert brute_force_optimum(level, 8) == known
    assert solution is not None and len(solution) == known
    game = SokobanGame(fixed[0], state[0], 1000)
    for action in solution:
        game.step(action)
    assert game.all_boxes_on_target()


def test_bfs_unsolvable_and_depth_limit():
    fixed, state = parse_sokoban_layouts(["######\n#X___#\n#__P_#\n#___O#\n#____#\n######"], 1, (6, 6))
    assert solve_sokoban(fixed[0], state[0]) is None  # box stuck in a corner
    fixed, state = parse_sokoban_layouts([HAND_LEVELS[0][0]], 1, (6, 6))
    assert solve_sokoban(fixed[0], state[0], max_depth=4) is None
    assert len(solve_sokoban(fixed[0], state[0], max_depth=5)) == 5


@pytest.mark.parametrize(
    "cfg,seeds", [({}, range(40)), ({"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}, range(15))]
)
def test_bfs_replay_solves_generated_levels(cfg, seeds):
    seeds = np.array(list(seeds))
    env = make("cpp", len(seeds), max_steps=200, **cfg)
    env.reset(seeds)
    solutions = env.solve(max_depth=200)
    assert all(s is not None and len(s) >= 1 for s in solutions)
    total = np.zeros(len(seeds))
    for t in range(max(len(s) for s in solutions)):
        actions = np.array([s[t] if t < len(s) else 0 for s in solutions], dtype=np.int32)
        _, reward, terminated, _, info = env.step(actions)
        total += reward
        finished = np.array([t == len(s) - 1 for s in solutions])
        assert np.array_equal(terminated & finished, finished) and np.array_equal(info["success"], terminated)
    assert env.get_state()["terminated"].all()
    lengths = np.array([len(s) for s in solutions])
    # -0.1 per action, +10 at the end, +1 per box pushed on net (start 0 on targets, end all on targets).
    np.testing.assert_allclose(total, -0.1 * lengths + 10 + cfg.get("num_boxes", 1), atol=1e-4)


def test_generated_levels_are_well_formed():
    for cfg in ({}, {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}, {"dim_room": (7, 9), "num_boxes": 3}):
        env = make("cpp", 64, **cfg)
        env.reset(np.arange(64) * 7919)
        state = env.get_state()
        rows, cols = cfg.get("dim_room", (6, 6))
        boxes = cfg.get("num_boxes", 1)
        fixed, room = state["room_fixed"], state["room_state"]
        assert fixed.shape == room.shape == (64, rows, cols)
        assert (fixed[:, 0, :] == 0).all() and (fixed[:, :, -1] == 0).all()  # border walls
        assert ((room == 5).sum(axis=(1, 2)) == 1).all()
        assert ((room == 4).sum(axis=(1, 2)) == boxes).all() and not (room == 3).any()
        assert ((fixed == 2).sum(axis=(1, 2)) == boxes).all()
        assert np.isin(fixed, [0, 1, 2]).all()
        # Movable things stand on floor.
        assert (fixed[room != 0] != 0).all() and (room[fixed == 0] == 0).all()


def test_rng_draw_order_of_topology_matches_written_spec():
    """The first draws of a seed, replayed by hand: direction, start, then per step (uniform, [dir], mask)."""
    from fastpo.envs.py_sokoban import TOPOLOGY_MASKS, WALK_DIRECTIONS, room_topology_generation
    from fastpo.envs.rng import STREAM_SOKOBAN_GEN, CounterRng

    rng = CounterRng(5, STREAM_SOKOBAN_GEN, 0)
    level = room_topology_generation(rng, (6, 6), 0.35, 20)
    replay = CounterRng(5, STREAM_SOKOBAN_GEN, 0)
    direction = WALK_DIRECTIONS[replay.randint(4)]
    pos = [1 + replay.randint(5), 1 + replay.randint(5)]
    counts = np.zeros((6, 6), dtype=int)
    for _ in range(20):
        if replay.uniform() < 0.35:
            direction = WALK_DIRECTIONS[replay.randint(4)]
        pos = [min(max(pos[0] + direction[0], 1), 4), min(max(pos[1] + direction[1], 1), 4)]
        counts[pos[0] - 1 : pos[0] + 2, pos[1] - 1 : pos[1] + 2] += TOPOLOGY_MASKS[replay.randint(5)]
    expected = (counts > 0).astype(np.uint8)
    expected[[0, -1], :] = 0
    expected[:, [0, -1]] = 0
    assert np.array_equal(level, expected) and replay.counter == rng.counter


def test_brute_force_enumerates_everything():
    # Guard the oracle itself: 4^3 sequences of length 3 are all distinct programs.
    assert len(list(itertools.product((UP, DOWN, LEFT, RIGHT), repeat=3))) == 64
    assert brute_force_optimum("######\n#PX_O#\n#____#\n#____#\n#____#\n######", 3) == 2
