"""Sudoku (RAGEN-2's sudoku env): RAGEN's feedback and renders character for character, its action parser, the
twin on random text actions, bad input.

The expected strings, rewards and validity flags were produced by RAGEN's own SudokuEnv (parse_action, step,
render; ragen/env/sudoku at mll-lab-nu/RAGEN commit 20daedc47558e000f7de912b060646bf2e8026bd, April 2026) on the
4x4 puzzle PUZZLE / SOLUTION, max_steps 30, stepping TEXTS in order; WITH_FEEDBACK[k] is the observation after
k actions (0: the first one).
"""

import numpy as np
import pytest
from twin_checks import BACKENDS, assert_bad_config_is_one_line

import fastpo.envs as envs
from fastpo.envs.sudoku import parse_action

SOLUTION = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
PUZZLE = [[1, 0, 0, 4], [0, 4, 0, 0], [2, 0, 0, 3], [0, 0, 2, 0]]
TEXTS = ["place 2 at row 1 col 2", "1,3,4", "place 4 at (2, 1)", "place 9 at row 1 col 1", "place 3 at row 1 col 1",
         "hello there", "row 5, 1, 1", "place 3 at 2,1", "place 3 at row 2 col 1", "(2,3,1)", "2 at 2,4",
         "place 3 at row 1 col 3", "3 at 3,2", "3,1,4", "3,2,1", "4,1,4", "4,2,3", "4,4,1", "place 3 at row 3 col 3",
         "place 4 at row 3 col 3"]
REWARDS = [1.0, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, 1.0, -0.1, 1.0, 1.0, 1.0, -0.1, -0.1, 1.0, 1.0, 1.0, 1.0, -0.1,
           11.0]
VALID = [True, False, False, False, False, False, False, True, False, True, True, True, False, False, True, True, True,
         True, False, True]
WITH_FEEDBACK = {
    0: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] . |  . [4]\n . [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (1,2): [2, 3]\n  - (1,3): [3]\n  - (2,1): [3]\n"
        "  - (2,3): [1, 3]\n  - (2,4): [1, 2]\n  - (3,2): [1]\n  - (3,3): [1, 4]\n  - (4,1): [3, 4]\n"
        "  - (4,2): [1, 3]\n  - (4,4): [1]\n\nProgress: 6/16 cells filled (6 initial, 0 placed)\nSteps: 0/30"
    ),
    2: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  . [4]\n . [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Invalid placement: 4 conflicts with row 1, box (1,2)\n   Valid numbers for (1,3): [3]\n\n"
        "💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (1,3): [3]\n  - (2,1): [3]\n  - (2,3): [1, 3]\n"
        "  - (2,4): [1, 2]\n  - (3,2): [1]\n  - (3,3): [1, 4]\n  - (4,1): [3, 4]\n  - (4,2): [1, 3]\n"
        "  - (4,4): [1]\n\nProgress: 7/16 cells filled (6 initial, 1 placed)\nSteps: 2/30"
    ),
    4: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  . [4]\n . [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Invalid action format: Number 9 is out of range (1-4)\n\n💡 VALID NUMBERS FOR EMPTY CELLS:\n"
        "  - (1,3): [3]\n  - (2,1): [3]\n  - (2,3): [1, 3]\n  - (2,4): [1, 2]\n  - (3,2): [1]\n"
        "  - (3,3): [1, 4]\n  - (4,1): [3, 4]\n  - (4,2): [1, 3]\n  - (4,4): [1]\n\n"
        "Progress: 7/16 cells filled (6 initial, 1 placed)\nSteps: 4/30"
    ),
    5: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  . [4]\n . [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Cannot modify initial cell at (1,1)\n\n💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (1,3): [3]\n"
        "  - (2,1): [3]\n  - (2,3): [1, 3]\n  - (2,4): [1, 2]\n  - (3,2): [1]\n  - (3,3): [1, 4]\n"
        "  - (4,1): [3, 4]\n  - (4,2): [1, 3]\n  - (4,4): [1]\n\n"
        "Progress: 7/16 cells filled (6 initial, 1 placed)\nSteps: 5/30"
    ),
    6: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  . [4]\n . [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Invalid action format: Could not parse action: 'hello there'. Expected format: "
        "'place 5 at row 2 col 3' or '2,3,5'\n"
        "\n💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (1,3): [3]\n  - (2,1): [3]\n  - (2,3): [1, 3]\n"
        "  - (2,4): [1, 2]\n  - (3,2): [1]\n  - (3,3): [1, 4]\n  - (4,1): [3, 4]\n  - (4,2): [1, 3]\n"
        "  - (4,4): [1]\n\nProgress: 7/16 cells filled (6 initial, 1 placed)\nSteps: 6/30"
    ),
    9: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  . [4]\n 3 [4]|  .  .\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Invalid placement: 3 conflicts with row 2, column 1, box (1,1)\n\n"
        "💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (1,3): [3]\n  - (2,3): [1]\n  - (2,4): [1, 2]\n"
        "  - (3,2): [1]\n  - (3,3): [1, 4]\n  - (4,1): [4]\n  - (4,2): [1, 3]\n  - (4,4): [1]\n\n"
        "Progress: 8/16 cells filled (6 initial, 2 placed)\nSteps: 9/30"
    ),
    13: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  3 [4]\n 3 [4]|  1  2\n-------------\n"
        "[2] . |  . [3]\n .  . | [2] .\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "❌ Invalid placement: 3 conflicts with row 3\n   Valid numbers for (3,2): [1]\n\n"
        "💡 VALID NUMBERS FOR EMPTY CELLS:\n  - (3,2): [1]\n  - (3,3): [4]\n  - (4,1): [4]\n"
        "  - (4,2): [1, 3]\n  - (4,4): [1]\n\nProgress: 11/16 cells filled (6 initial, 5 placed)\n"
        "Steps: 13/30"
    ),
    20: (
        "==================================================\nSUDOKU PUZZLE\n"
        "==================================================\n[1] 2 |  3 [4]\n 3 [4]|  1  2\n-------------\n"
        "[2] 1 |  4 [3]\n 4  3 | [2] 1\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
        "✓ Correct! Placed 4 at (3,3)\n🎉 Congratulations! Puzzle solved!\n\n"
        "Progress: 16/16 cells filled (6 initial, 10 placed)\nSteps: 20/30"
    ),
}
DETAILED_LAST = (
    "==================================================\nSUDOKU PUZZLE\n"
    "==================================================\n[1] 2 |  3 [4]\n 3 [4]|  1  2\n-------------\n"
    "[2] 1 |  4 [3]\n 4  3 | [2] 1\n\nLegend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty\n\n"
    "✓ Correct! Placed 4 at (3,3)\n🎉 Congratulations! Puzzle solved!"
)
SIMPLE_LAST = (
    "1 2 | 3 4\n3 4 | 1 2\n---------\n2 1 | 4 3\n4 3 | 2 1"
)


def make(backend, n=1, **cfg):
    return envs.make("sudoku", n, backend=backend, **cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_feedback_and_renders_equal_ragens(backend):
    env = make(backend, 1, grid_size=4, render_format="with_feedback", max_steps=30)
    observations = [env.reset_from_puzzles(np.array([PUZZLE]), np.array([SOLUTION]))[0]]
    rewards, valid = [], []
    for k, text in enumerate(TEXTS):
        obs, reward, term, trunc, info = env.step([text])
        observations.append(obs[0])
        rewards.append(float(reward[0]))
        valid.append(bool(info["action_is_valid"][0]))
        assert term[0] == (k == len(TEXTS) - 1) and info["success"][0] == term[0] and not trunc[0]
    for k, expected in WITH_FEEDBACK.items():
        assert observations[k] == expected, k
    assert rewards == [float(np.float32(r)) for r in REWARDS] and valid == VALID
    for fmt, last in (("detailed", DETAILED_LAST), ("simple", SIMPLE_LAST)):
        other = make(backend, 1, grid_size=4, render_format=fmt, max_steps=30)
        other.reset_from_puzzles(np.array([PUZZLE]), np.array([SOLUTION]))
        for text in TEXTS:
            obs = other.step([text])[0]
        assert obs[0] == last


@pytest.mark.parametrize("text,expected", [
    # RAGEN's parse_action at 20daedc on 9x9: (ok, row, col, num, message), row and col 0-based
    ("place \u0663 at row 1 col 1", (True, 0, 0, 3, "")),  # a non-ASCII digit: int() reads it
    ("99999999999999999999,1,1", (False, -1, -1, -1, "Row 99999999999999999999 is out of range (1-9)")),
    ("\uff30\uff2c\uff21\uff23\uff25 1 at row 1 col 1",
     (False, -1, -1, -1, "Could not parse action: '\uff50\uff4c\uff41\uff43\uff45 1 at row 1 col 1'. Expected "
                         "format: 'place 5 at row 2 col 3' or '2,3,5'")),
    ("  Place 7 AT ROW 3 COL 3  ", (True, 2, 2, 7, "")),
    ("1,2,3 at", (True, 1, 2, 1, "")),  # "at" anywhere: the first number is the value
    ("what 1,2,3", (True, 1, 2, 1, "")),
])
def test_parse_equals_ragens_and_the_env_agrees(text, expected):
    ok, row, col, num, message = expected
    kind, r, c, n, msg = parse_action(text, 9)
    assert (kind == 1, msg) == (ok, message) and (not ok or (r, c, n) == (row, col, num))
    # the C++ env parses ASCII itself and hands other text (and overlong numbers) to parse_action
    for backend in BACKENDS:
        env = make(backend, 1, grid_size=9)
        env.reset(np.array([5]))
        obs = env.step([text])[0][0]
        if not ok:
            assert f"\u274c Invalid action format: {message}" in obs


def test_ascii_parser_equals_python_on_random_text():
    """The C++ parser (ASCII) and parse_action agree on 4,000 random texts built from the patterns' pieces."""
    rng = np.random.default_rng(0)
    pieces = ["place", "at", "row", "col", " ", "  ", ",", "(", ")", "\t", "PLACE", "At", "x", "9", "5", "12", "0",
              "3", "\x1c", "\n", "0000000000000000000007", "1234567890123456789012"]
    texts = ["".join(rng.choice(pieces, rng.integers(0, 12))) for _ in range(4_000)]
    n = len(texts)
    cpp, py = make("cpp", n, grid_size=4, max_steps=5), make("python", n, grid_size=4, max_steps=5)
    for env in (cpp, py):
        env.reset_from_puzzles(np.array([PUZZLE] * n), np.array([SOLUTION] * n))
    a, b = cpp.step(texts), py.step(texts)
    assert a[0] == b[0] and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("config,message", [
    ({"grid_size": 16}, r"^grid_size must be 4 or 9, got 16$"),
    ({"difficulty": "expert"}, r"^difficulty must be one of \['easy', 'hard', 'medium'\], got 'expert'$"),
    ({"render_format": "fancy"}, r"^render_format must be one of \['detailed', 'simple', 'with_feedback'\]"),
    ({"completion_bonus": float("inf")}, r"^completion_bonus must be a finite number, got inf$"),
    ({"show_candidates": True}, r"^unknown config key\(s\) \['show_candidates'\] for env 'sudoku'"),
])
def test_bad_config_is_one_line(config, message):
    assert_bad_config_is_one_line("sudoku", config, message)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_puzzles_and_actions(backend):
    env = make(backend, 1, grid_size=4)
    bad = [row[:] for row in SOLUTION]
    bad[2][1] = 3
    with pytest.raises(ValueError, match=r"^solution of env 0: row 3 is \[2, 3, 4, 3\], not the numbers 1..4$"):
        env.reset_from_puzzles(np.array([PUZZLE]), np.array([bad]))
    wrong = [row[:] for row in PUZZLE]
    wrong[0][1] = 3
    with pytest.raises(ValueError, match=r"^puzzle of env 0: row 1, column 2 holds 3, but the solution has 2"):
        env.reset_from_puzzles(np.array([wrong]), np.array([SOLUTION]))
    with pytest.raises(RuntimeError, match="never reset"):
        env.step(["1,1,1"])
    env.reset(np.array([0]))
    with pytest.raises(ValueError, match="actions must be a list of 1 strings"):
        env.step("1,1,1")
    with pytest.raises(ValueError, match=r"actions\[0\] must be a str"):
        env.step([5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_generated_puzzles(backend):
    env = make(backend, 50, difficulty="medium")
    env.reset(np.arange(50))
    state = env.get_state()
    for i in range(50):
        check = envs.make("sudoku", 1, backend="python", difficulty="medium")
        check.reset_from_puzzles(state["initial"][i:i + 1], state["solution"][i:i + 1])  # a valid pair
        assert (state["initial"][i] == 0).sum() == 40  # int(81 * 0.5)
    assert len({state["solution"][i].tobytes() for i in range(50)}) == 50


def test_registry_presets_and_prompts():
    from fastpo.prompts import prompt_spec

    env = envs.make("simple_sudoku", 1)
    assert env.action_space == "text" and env.config.render_format == "with_feedback"
    assert envs.make("medium_sudoku", 1, backend="python").config.difficulty == "medium"
    # RAGEN's prefix for SimpleSudoku / MediumSudoku (config/envs.yaml at 20daedc): the instruction alone
    text = ("You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and 3x3 box contains the "
            "numbers 1-9 without repetition.\nInitial cells are shown in [brackets] and cannot be modified. Empty "
            "cells are shown as dots (.).\nPlace numbers one at a time using the format: <answer>place 5 at row 2 "
            "col 3</answer> or <answer>2,3,5</answer>\nThe environment will provide feedback on valid/invalid moves "
            "and show conflicts if any occur.\n")
    for tag, budget in (("SimpleSudoku", 20), ("MediumSudoku", 30)):
        spec = prompt_spec(tag)
        assert spec.prefix() == text and spec.max_actions_per_traj == budget and spec.max_tokens == 150


def run_text_pair(cfg, num_envs, rounds, steps, seed):
    """Random text episodes on both backends; every output and the state must be identical."""
    cpp, py = make("cpp", num_envs, **cfg), make("python", num_envs, **cfg)
    rng = np.random.default_rng(seed)
    size = cpp.config.grid_size
    for _ in range(rounds):
        seeds = rng.integers(-(2**62), 2**62, num_envs)
        assert cpp.reset(seeds) == py.reset(seeds)
        solution = cpp.get_state()["solution"]
        for _ in range(steps):
            texts = []
            for i in range(num_envs):
                r, c = rng.integers(0, size, 2)
                u = rng.random()
                if u < 0.45:
                    texts.append(f"place {solution[i, r, c]} at row {r + 1} col {c + 1}")
                elif u < 0.8:
                    texts.append(f"{r + 1},{c + 1},{rng.integers(0, size + 2)}")
                else:
                    odd = ["nonsense", "(1,1,1)", "place 3 at (2, 2)", "5 at 1,1", "\u0663,1,1"]
                    texts.append(str(rng.choice(odd)))
            active = rng.random(num_envs) < 0.9
            a, b = cpp.step(texts, active=active), py.step(texts, active=active)
            assert a[0] == b[0]
            for k in (1, 2, 3):
                assert np.array_equal(a[k], b[k])
            for key in b[4]:
                assert np.array_equal(a[4][key], b[4][key]), key
            assert np.array_equal(cpp.state_keys(), py.state_keys())
        sa, sb = cpp.get_state(), py.get_state()
        for key in sb:
            assert sa[key].dtype == sb[key].dtype and np.array_equal(sa[key], sb[key]), key
    return num_envs * rounds


@pytest.mark.parametrize("cfg", [{"render_format": "with_feedback", "max_steps": 40},
                                 {"grid_size": 4, "render_format": "detailed", "difficulty": "hard"},
                                 {"render_format": "simple", "num_threads": 2}])
def test_twin_equal_on_random_text(cfg):
    assert run_text_pair(cfg, num_envs=30, rounds=1, steps=30, seed=1) == 30


@pytest.mark.slow
def test_twin_equal_on_thousands_of_sequences():
    total = 0
    for k, cfg in enumerate([{"render_format": "with_feedback", "max_steps": 30},
                             {"grid_size": 4, "render_format": "with_feedback", "difficulty": "medium"},
                             {"difficulty": "hard", "render_format": "detailed", "num_threads": 2}]):
        total += run_text_pair(cfg, num_envs=200, rounds=4, steps=40, seed=k)
    assert total >= 2400
