"""The 2x2 Rubik's cube (RAGEN-2's rubikscube): RAGEN's turns and observation text, solving, budget, the twin.

The expected stickers and texts were produced by RAGEN's own RubiksCube2x2Env methods (_apply_action and the
turns, render) at mll-lab-nu/RAGEN commit 20daedc47558e000f7de912b060646bf2e8026bd (April 2026): from the solved
cube, the turns 1, 7, 10, 4, 12, 6 (U, R, F', D', B', L'), max_steps 20.
"""

import numpy as np
import pytest
from twin_checks import BACKENDS, assert_bad_config_is_one_line

import fastpo.envs as envs

SOLVED = [k // 4 for k in range(24)]
TAIL = "\n\nAvailable Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?"
RAGEN_SOLVED = ("=== Rubik's Cube 2x2 State ===\nStep: 0/20\n\nUp (U):    [W, W]\n [W, W]\nLeft (L):  [O, O]\n [O, O]\n"
                "Front (F): [G, G]\n [G, G]\nRight (R): [R, R]\n [R, R]\nBack (B):  [B, B]\n [B, B]\n"
                "Down (D):  [Y, Y]\n [Y, Y]" + TAIL)
RAGEN_TURNS = [1, 7, 10, 4, 12, 6]
RAGEN_STICKERS = [5, 2, 5, 3, 2, 2, 5, 2, 1, 5, 4, 4, 4, 0, 0, 3, 1, 3, 0, 3, 1, 1, 0, 4]
RAGEN_AFTER = ("=== Rubik's Cube 2x2 State ===\nStep: 6/20\n\nUp (U):    [Y, G]\n [Y, R]\nLeft (L):  [G, G]\n [Y, G]\n"
               "Front (F): [O, Y]\n [B, B]\nRight (R): [B, W]\n [W, R]\nBack (B):  [O, R]\n [W, R]\n"
               "Down (D):  [O, O]\n [W, B]" + TAIL)


def make(backend, n=1, **cfg):
    return envs.make("rubikscube", n, backend=backend, **cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_turns_and_text_equal_ragens(backend):
    env = make(backend, 1, max_steps=20)
    assert env.reset_from_cubes(np.array([SOLVED])) == [RAGEN_SOLVED]
    for action in RAGEN_TURNS:
        obs, reward, term, trunc, info = env.step(np.array([action], dtype=np.int32))
        assert reward[0] == 0 and not term[0] and info["action_is_valid"][0] and info["action_is_effective"][0]
    assert obs == [RAGEN_AFTER] and env.get_state()["stickers"][0].tolist() == RAGEN_STICKERS


@pytest.mark.parametrize("backend", BACKENDS)
def test_solving_budget_and_no_ops(backend):
    env = make(backend, 3, max_steps=4)
    env.reset_from_cubes(np.array([SOLVED] * 3))
    env.step(np.array([9, 1, 5], dtype=np.int32))  # F, U, L
    _, reward, term, trunc, info = env.step(np.array([10, 1, 0], dtype=np.int32))  # F' solves env 0; U U; none
    assert reward.tolist() == [1.0, 0.0, 0.0] and term.tolist() == [True, False, False]
    assert info["success"].tolist() == [True, False, False] and info["action_is_valid"].tolist() == [True, True, False]
    _, reward, term, trunc, info = env.step(np.array([3, 1, 13], dtype=np.int32))  # finished; U U U; id 13
    assert not trunc.any() and info["action_is_valid"].tolist() == [False, True, False]
    _, reward, term, trunc, info = env.step(np.array([3, 1, 9], dtype=np.int32))  # U^4 solves env 1 at its budget
    assert term.tolist() == [True, True, False] and reward.tolist() == [0.0, 1.0, 0.0] and not trunc.any()
    for _ in range(2):
        _, reward, term, trunc, info = env.step(np.array([0, 0, 9], dtype=np.int32))  # env 2: L F F F
    assert trunc.tolist() == [False, False, True] and not term[2] and info["success"].tolist() == [True, True, False]
    assert env.get_state()["num_steps"].tolist() == [2, 4, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scramble_depends_on_seed_and_depth(backend):
    zero = make(backend, 4, scramble_depth=0)
    assert zero.reset(np.arange(4)) == [RAGEN_SOLVED] * 4
    env = make(backend, 200, scramble_depth=1)
    env.reset(np.arange(200))
    stickers = env.get_state()["stickers"]
    assert len({s.tobytes() for s in stickers}) == 12  # one turn: the 12 distinct one-turn cubes


@pytest.mark.parametrize("config,message", [
    ({"scramble_depth": -1}, r"^scramble_depth must be an int in \[0, 1000\], got -1$"),
    ({"max_steps": 0}, r"^max_steps must be an int in"),
    ({"render_mode": "text"}, r"^unknown config key\(s\) \['render_mode'\] for env 'rubikscube'"),
])
def test_bad_config_is_one_line(config, message):
    assert_bad_config_is_one_line("rubikscube", config, message)


def test_bad_cubes():
    with pytest.raises(ValueError, match=r"^cube of env 0: colours must be 0..5 with 4 stickers each"):
        make("cpp", 1).reset_from_cubes(np.array([[0] * 24]))


def test_prompt_and_registry():
    from fastpo.prompts import prompt_spec

    spec = prompt_spec("rubikscube")
    assert spec.max_actions_per_traj == 20 and spec.max_tokens == 96
    # RAGEN's prefix for the rubikscube tag (config/envs.yaml and RubiksCube2x2Config at 20daedc)
    assert spec.prefix() == (
        "You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore the cube so that each of the faces "
        "consists of a single, unique color.\nAvailable actions use standard Singmaster notation for face rotations: "
        "U, U', D, D', L, L', R, R', F, F', B, B'.\n- Faces: U (Up), D (Down), L (Left), R (Right), F (Front), "
        "B (Back).\n- Modifiers: A letter alone means 90\u00b0 clockwise (e.g., 'R'). A letter with prime (') means "
        "90\u00b0 counter-clockwise (e.g., \"R'\").\nRespond with a sequence of actions separated by \"||\".\n"
        "Example: <answer>U</answer>\n\nYour available actions are:\nU, U', D, D', L, L', R, R', F, F', B, B'\n"
        'You can make up to 20 actions, separated by the action separator " || "\n'
    )
    assert envs.step_limit_config("rubikscube", 30, {}) == {"max_steps": 30}


def test_twin_equal_on_random_sequences():
    from test_cpp_vs_python import run_pair

    assert run_pair("rubikscube", {"scramble_depth": 2, "max_steps": 12}, 60, 2, 14, seed=5) >= 120


@pytest.mark.slow
def test_twin_equal_on_thousands_of_sequences():
    from test_cpp_vs_python import run_pair

    total = sum(run_pair("rubikscube", cfg, 200, 8, 14, seed=k) for k, cfg in enumerate(
        [{"scramble_depth": 1, "max_steps": 20}, {"scramble_depth": 5, "num_threads": 2}]))
    assert total >= 3200
