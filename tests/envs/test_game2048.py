"""2048 (RAGEN-2's game_2048): RAGEN's observation text and move rules, rewards, the end of a game, the twin, bad input.

The expected observations and slides were produced by RAGEN's own Game2048Env methods (render, _move_sim,
_compress_and_merge) at mll-lab-nu/RAGEN commit 20daedc47558e000f7de912b060646bf2e8026bd (April 2026) on the
boards below (score 1234).
"""

import math

import numpy as np
import pytest
from twin_checks import BACKENDS, assert_bad_config_is_one_line

import fastpo.envs as envs
from fastpo.envs.rng import STREAM_GAME2048, CounterRng

UP, RIGHT, DOWN, LEFT = 1, 2, 3, 4  # RAGEN's 0..3 plus one
MIXED = [[2, 2, 2, 2], [4, 0, 4, 8], [0, 0, 0, 2], [16, 8, 8, 0]]
STUCK = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
CORNER = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2]]
RAGEN_RENDERS = {  # board -> RAGEN's render() with score 1234
    "MIXED": "Current 2048 Grid:\nRow 1: [2, 2, 2, 2]\nRow 2: [4, 0, 4, 8]\nRow 3: [0, 0, 0, 2]\n"
             "Row 4: [16, 8, 8, 0]\n\nValid Actions: 0(Up), 1(Right), 2(Down), 3(Left).\n"
             "Goal: Merge same numbers to reach 2048.\nCurrent Score: 1234\nWhat is your next move?",
    "STUCK": "Current 2048 Grid:\nRow 1: [2, 4, 2, 4]\nRow 2: [4, 2, 4, 2]\nRow 3: [2, 4, 2, 4]\n"
             "Row 4: [4, 2, 4, 2]\n\nValid Actions: None.\n"
             "Goal: Merge same numbers to reach 2048.\nCurrent Score: 1234\nWhat is your next move?",
    "CORNER": "Current 2048 Grid:\nRow 1: [0, 0, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\n"
              "Row 4: [0, 0, 0, 2]\n\nValid Actions: 0(Up), 3(Left).\n"
              "Goal: Merge same numbers to reach 2048.\nCurrent Score: 1234\nWhat is your next move?",
}
RAGEN_SLIDES = {  # (board, RAGEN direction) -> (board after _move_sim, merged sum)
    ("MIXED", 0): ([[2, 2, 2, 2], [4, 8, 4, 8], [16, 0, 8, 2], [0, 0, 0, 0]], 0),
    ("MIXED", 1): ([[0, 0, 4, 4], [0, 0, 8, 8], [0, 0, 0, 2], [0, 0, 16, 16]], 32),
    ("MIXED", 2): ([[0, 0, 0, 0], [2, 0, 2, 2], [4, 2, 4, 8], [16, 8, 8, 2]], 0),
    ("MIXED", 3): ([[4, 4, 0, 0], [8, 8, 0, 0], [2, 0, 0, 0], [16, 16, 0, 0]], 32),
}


def make(backend, n=1, **cfg):
    return envs.make("game_2048", n, backend=backend, **cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_observation_equals_ragens_render(backend):
    env = make(backend, 3)
    obs = env.reset_from_boards(np.array([MIXED, STUCK, CORNER]))
    for text, name in zip(obs, ["MIXED", "STUCK", "CORNER"], strict=True):
        assert text == RAGEN_RENDERS[name].replace("Current Score: 1234", "Current Score: 0")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", [0, 1, 2, 3])
@pytest.mark.parametrize("log_reward", [True, False])
def test_slides_rewards_and_one_spawn(backend, direction, log_reward):
    seed = 9
    env = make(backend, 1, use_log_reward=log_reward)
    env.reset_from_boards(np.array([MIXED]), seeds=[seed])
    obs, reward, term, trunc, info = env.step(np.array([direction + 1], dtype=np.int32))
    after, merged = RAGEN_SLIDES[("MIXED", direction)]
    expected = math.log2(merged + 1.0) * 0.1 if merged > 0 else 0.0
    assert reward[0] == np.float32(expected if log_reward else float(merged))
    assert info["action_is_valid"][0] and info["action_is_effective"][0] and not term[0] and not trunc[0]
    # the spawn: draw 1 picks the empty cell (row-major), draw 2 the value
    rng = CounterRng(seed, STREAM_GAME2048)
    empty = [(r, c) for r in range(4) for c in range(4) if after[r][c] == 0]
    r, c = empty[rng.randint(len(empty))]
    after = [row[:] for row in after]
    after[r][c] = 2 if rng.uniform() < 0.9 else 4
    state = env.get_state()
    assert state["grid"][0].tolist() == after and state["score"].tolist() == [merged]
    assert state["spawn_draws"].tolist() == [2] and state["num_steps"].tolist() == [1]
    assert f"Current Score: {merged}\n" in obs[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_move_that_moves_nothing(backend):
    for log_reward, penalty in ((True, 0.0), (False, -0.1)):
        env = make(backend, 1, use_log_reward=log_reward, max_steps=3)
        env.reset_from_boards(np.array([CORNER]))
        for _ in range(2):
            obs, reward, term, trunc, info = env.step(np.array([RIGHT], dtype=np.int32))
            assert reward[0] == np.float32(penalty) and not info["action_is_valid"][0]
            assert not info["action_is_effective"][0] and obs[0] == RAGEN_RENDERS["CORNER"].replace("1234", "0")
        assert not trunc[0] and env.get_state()["num_steps"].tolist() == [2]  # it costs a step
        obs, reward, term, trunc, info = env.step(np.array([DOWN], dtype=np.int32))
        assert trunc[0] and not term[0]
        for bad in (0, 5, -1):  # after the end, and ids outside 1..4, nothing happens
            _, reward, term, trunc, info = env.step(np.array([bad], dtype=np.int32))
            assert reward[0] == 0 and not info["action_is_valid"][0] and trunc[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_game_ends_when_no_move_is_left_and_success_needs_2048(backend):
    # Right fills the one empty cell of `almost` with a 2 next to a 2; Left on `won` merges a 2048 with a move left.
    almost = [[2, 4, 8, 0], [4, 8, 16, 32], [8, 16, 32, 64], [16, 32, 64, 128]]
    won = [[1024, 1024, 4, 2], [4, 8, 16, 32], [8, 16, 32, 64], [16, 32, 64, 128]]
    env = make(backend, 2, two_prob=1.0)
    env.reset_from_boards(np.array([almost, won]))
    _, reward, term, trunc, info = env.step(np.array([RIGHT, LEFT], dtype=np.int32))
    grid = env.get_state()["grid"]
    assert grid[0].tolist() == [[2, 2, 4, 8], [4, 8, 16, 32], [8, 16, 32, 64], [16, 32, 64, 128]]
    assert not term[0] and info["action_is_valid"][0] and reward[0] == 0  # Right moved; 2 2 still merges
    assert grid[1][0].tolist() == [2048, 4, 2, 2] and not term[1]  # merged 2048, but a move is left
    assert reward[1] == np.float32(math.log2(2049.0) * 0.1) and not info["success"][1]
    env.reset_from_boards(np.array([[[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [0, 4, 2, 4]],
                                    [[2048, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [0, 4, 2, 4]]]))
    obs, _, term, _, info = env.step(np.array([LEFT, LEFT], dtype=np.int32))  # the 2 spawned at (3, 3) sticks
    assert term.tolist() == [True, True] and info["success"].tolist() == [False, True]
    assert "Valid Actions: None." in obs[0]
    _, reward, term, _, info = env.step(np.array([UP, UP], dtype=np.int32))  # finished: a no-op
    assert term.all() and not info["action_is_valid"].any() and info["success"].tolist() == [False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_spawns_two_tiles_from_the_seed(backend):
    env = make(backend, 200)
    env.reset(np.arange(200))
    grid = env.get_state()["grid"].reshape(200, -1)
    assert ((grid > 0).sum(1) == 2).all() and set(np.unique(grid)) <= {0, 2, 4}
    assert 0.8 < (grid == 2).sum() / (grid > 0).sum() < 0.97  # two_prob 0.9
    again = make(backend, 200)
    again.reset(np.arange(200))
    assert np.array_equal(again.get_state()["grid"].reshape(200, -1), grid)


@pytest.mark.parametrize("config,message", [
    ({"size": 7}, r"^size must be an int in \[2, 6\], got 7$"),
    ({"two_prob": 1.5}, r"^two_prob must be in \[0.0, 1.0\], got 1.5$"),
    ({"use_log_reward": 1}, r"^use_log_reward must be a bool, got 1$"),
    ({"max_steps": 0}, r"^max_steps must be an int in"),
    ({"grid_size": 4}, r"^unknown config key\(s\) \['grid_size'\] for env 'game_2048'"),
])
def test_bad_config_is_one_line(config, message):
    assert_bad_config_is_one_line("game_2048", config, message)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_boards_and_actions(backend):
    env = make(backend, 1)
    with pytest.raises(ValueError, match=r"^board of env 0: row 1, column 2 holds 6; tiles are 0"):
        env.reset_from_boards(np.array([[[0, 0, 0, 0], [0, 0, 6, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]))
    with pytest.raises(ValueError, match=r"^boards must have shape \(1, 4, 4\), got \(4, 4\)"):
        env.reset_from_boards(np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(RuntimeError, match="never reset"):
        env.step(np.array([1], dtype=np.int32))
    env.reset(np.arange(1))
    with pytest.raises(ValueError, match="actions must be integer ids"):
        env.step(np.array([1.0]))


def test_registry_names_and_prompt():
    from fastpo.prompts import prompt_spec

    assert type(envs.make("2048", 1)).__name__ == "Game2048Env"
    assert type(envs.make("game_2048", 1, backend="python")).__name__ == "PyGame2048Env"
    assert envs.step_limit_config("game_2048", 900, {}) == {"max_steps": 900}
    # RAGEN's prefix for the game_2048 tag (config/envs.yaml and Game2048EnvConfig at 20daedc; see the module text)
    assert prompt_spec("game_2048").prefix() == (
        "You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding Up, Right, Down, or Left.\n"
        "If a move is invalid (no tiles move), a small penalty is applied. Respond with a single action.\n"
        "Example: <answer>Up</answer>\n\nYour available actions are:\nUp, Right, Down, Left\n"
        'You can make up to 700 actions, separated by the action separator " || "\n'
    )
    assert prompt_spec("game_2048").max_tokens == 8192


def test_twin_equal_on_random_sequences():
    from test_cpp_vs_python import run_pair

    assert run_pair("game_2048", {"max_steps": 40}, num_envs=60, rounds=2, steps=40, seed=3) >= 120
    assert run_pair("game_2048", {"size": 3, "use_log_reward": False, "two_prob": 0.5}, 40, 2, 30, 4) >= 80


@pytest.mark.slow
def test_twin_equal_on_thousands_of_sequences():
    """Over 5,000 random action sequences, long enough for games to end (3x3 boards fill quickly)."""
    total = 0
    for k, (cfg, steps) in enumerate([({}, 60), ({"size": 3}, 80), ({"size": 5, "num_threads": 2}, 40),
                                      ({"use_log_reward": False, "two_prob": 0.3}, 60)]):
        total += run_pair_quiet("game_2048", {"max_steps": steps, **cfg}, steps, k)
    assert total >= 5000


def run_pair_quiet(name, cfg, steps, seed):
    from test_cpp_vs_python import run_pair

    return run_pair(name, cfg, num_envs=200, rounds=7, steps=steps, seed=seed)
