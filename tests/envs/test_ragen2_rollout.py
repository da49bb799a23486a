"""RAGEN-2's envs in fastpo's multi-turn rollout (a scripted engine): actions parsed from the answers, the env
stepped and rendered, RAGEN's prompt text in the chat, rewards per turn."""

import numpy as np
import pytest

import fastpo.envs as E
from fastpo import testing
from fastpo.config import RolloutConfig
from fastpo.engine import SamplingParams
from fastpo.prompts import prompt_spec
from fastpo.rollout import run_rollout


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return testing.build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_ragen2"))


def rollout(tok, env, spec, script):
    n = env.num_envs
    engine = testing.ScriptedEngine(tok, script)
    return run_rollout(env, engine, tok, spec, np.arange(n), np.arange(n), RolloutConfig(),
                       SamplingParams(max_new_tokens=64), list(range(n)), already_reset=True, max_turns=2)


def answer(text):
    return f"ok</think><answer>{text}</answer>"


def test_2048_sudoku_cube_and_bandit_split_in_a_rollout(tok):
    cube = E.make("rubikscube", 1)
    cube.reset_from_cubes(np.array([[k // 4 for k in range(24)]]))
    cube.step(np.array([2], dtype=np.int32))  # U': U solves it
    cube_env = E.make("rubikscube", 1)
    cube_env.reset_from_cubes(cube.get_state()["stickers"])
    batch = rollout(tok, cube_env, prompt_spec("rubikscube"), [[answer("U"), answer("U")]])
    traj = batch.trajectories[0]
    assert traj.reward == pytest.approx(1.0) and traj.success
    assert traj.messages[1]["content"].startswith("You are solving a 2x2 Rubik's Cube")

    board = E.make("game_2048", 1)
    board.reset_from_boards(np.array([[[2, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]))
    batch = rollout(tok, board, prompt_spec("game_2048"), [[answer("Left"), answer("Up")]])
    assert batch.trajectories[0].messages[2]["content"] != ""  # the assistant turn
    first_reward = batch.trajectories[0].messages[3]["content"]
    assert first_reward.startswith(f"Reward:\n{float(str(np.float32(np.log2(5.0) * 0.1)))}\n\nTurn 2:\nState:\n")

    sudoku = E.make("simple_sudoku", 1)
    sudoku.reset(np.array([3]))
    state = sudoku.get_state()
    r, c = map(int, np.argwhere(state["initial"][0] == 0)[0])
    right = f"place {state['solution'][0, r, c]} at row {r + 1} col {c + 1}"
    batch = rollout(tok, sudoku, prompt_spec("SimpleSudoku"), [[answer(f"{right} || hello"), answer("1,1,1")]])
    traj = batch.trajectories[0]
    assert traj.messages[3]["content"].startswith(f"Reward:\n{1.0 + float(str(np.float32(-0.1)))}\n")
    assert "Could not parse action: 'hello'" in traj.messages[3]["content"]

    bandit = E.make("bandit", 2, split="test")
    bandit.reset(np.arange(2))
    hi = [bandit.action_names[s[0] - 1] for s in bandit.solve()]
    batch = rollout(tok, bandit, prompt_spec("bandit"), [[answer(hi[0])], [answer(hi[1].lower())]])
    assert all(t.success for t in batch.trajectories)
