"""fastpo.sft: expert data in RAGEN's exact chat format, loss masks, replayable actions, noise share, training."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastpo import envs, testing
from fastpo.prompts import render_chat
from fastpo.sft_core import build_sft_dataset, generate_episodes, lr_at, tokenize_episode, train_sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NON_SLIPPERY = {"is_slippery": False}
FORMAT = (
    "You have {k} actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer>"
    " with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n"
)
HEAD = "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n"
GOLDEN_FROZENLAKE = (
    HEAD + "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the"
    " unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go to the"
    " target, I should go left then go up.</think><answer>Left || Up</answer>\nThe meaning of each symbol in the"
    " state is:\nP: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal\nYour available"
    ' actions are:\nLeft, Down, Right, Up\nYou can make up to 10 actions, separated by the action separator " || "\n'
    "\nTurn 1:\nState:\n___O\n____\nO___\n_POG\n" + FORMAT.format(k=10) + "<|im_end|>\n<|im_start|>assistant\n"
    "<think>I should avoid the holes and go to the goal.</think><answer>Up || Right || Right</answer><|im_end|>\n"
    "<|im_start|>user\nReward:\n0.0\n\nTurn 2:\nState:\n___O\n____\nO__P\n__OG\n" + FORMAT.format(k=7) + "<|im_end|>\n"
    "<|im_start|>assistant\n<think>I should avoid the holes and go to the goal.</think><answer>Down</answer>"
    "<|im_end|>\n"
)
GOLDEN_SOKOBAN = (
    HEAD + "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. When"
    " you are right next to a box, you can push it by moving in the same direction. You cannot push a box through a"
    " wall, and you cannot pull a box. The answer should be a sequence of actions, like <answer>Right || Right ||"
    " Up</answer>\nThe meaning of each symbol in the state is:\n#: wall, _: empty, O: target, √: box on target, X:"
    " box, P: player, S: player on target\nYour available actions are:\nUp, Down, Left, Right\nYou can make up to 10"
    ' actions, separated by the action separator " || "\n\nTurn 1:\nState:\n######\n##_O_#\n###__#\n##PX_#\n##___#\n'
    "######\n" + FORMAT.format(k=10) + "<|im_end|>\n<|im_start|>assistant\n<think>I should push the box onto the"
    " target.</think><answer>Down || Right || Up</answer><|im_end|>\n<|im_start|>user\nReward:\n-0.30000000000000004"
    "\n\nTurn 2:\nState:\n######\n##_O_#\n###X_#\n##_P_#\n##___#\n######\n" + FORMAT.format(k=7) + "<|im_end|>\n"
    "<|im_start|>assistant\n<think>I should push the box onto the target.</think><answer>Up</answer><|im_end|>\n"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sft")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, hidden=32, layers=1, heads=2, kv_heads=1, seed=0)
    return path, tok


@pytest.mark.parametrize(
    "env_name, kwargs, golden",
    [("frozenlake", NON_SLIPPERY, GOLDEN_FROZENLAKE), ("sokoban", {}, GOLDEN_SOKOBAN)],
)
def test_golden_sample_and_mask(tiny, env_name, kwargs, golden):
    _, tok = tiny
    (episode,) = generate_episodes(env_name, 1, seed=2, noise=0.0, max_actions_per_turn=3, env_kwargs=kwargs)
    ids, mask = tokenize_episode(tok, episode)
    assert tok.decode(ids) == golden
    assert render_chat(tok, episode.messages, for_update=True) == golden
    # the mask covers exactly each assistant content plus its <|im_end|>, as contiguous spans
    contents = [m["content"] + "<|im_end|>" for m in episode.messages if m["role"] == "assistant"]
    spans, start = [], None
    for j, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = j
        elif not bit and start is not None:
            spans.append(tok.decode(ids[start:j]))
            start = None
    assert spans == contents


def _replay(env_name, kwargs, episode):
    env = envs.make(env_name, 1, **kwargs)
    env.reset([episode.seed])
    first = env.solve()[0]
    success = False
    for turn in episode.actions:
        for a in turn:
            _, _, terminated, truncated, info = env.step(np.array([a], dtype=np.int32))
            success = bool(info["success"][0])
            if terminated[0] or truncated[0]:
                break
    return first, success


@pytest.mark.parametrize("env_name, kwargs", [("frozenlake", NON_SLIPPERY), ("sokoban", {})])
def test_noise_free_actions_solve_the_level(env_name, kwargs):
    episodes = generate_episodes(env_name, 40, seed=500, noise=0.0, env_kwargs=kwargs)
    assert len(episodes) >= 35
    for ep in episodes:
        assert not any(any(r) for r in ep.random)
        first, success = _replay(env_name, kwargs, ep)
        assert success == ep.success
        assert success == (len(first) <= 10), (ep.seed, first, ep.actions)
        assert all(1 <= len(a) <= 5 for a in ep.actions)


@pytest.mark.parametrize("env_name, kwargs", [("frozenlake", {}), ("sokoban", {}), ("bandit", {}), ("countdown", {}),
                                             ("bandit", {"split": "train"}), ("bandit", {"split": "test"})])
def test_noise_share(env_name, kwargs):
    episodes = generate_episodes(env_name, 300, seed=7, noise=0.3, env_kwargs=kwargs)
    flags = [f for ep in episodes for turn in ep.random for f in turn]
    assert abs(np.mean(flags) - 0.3) < 0.05, np.mean(flags)
    if env_name == "bandit":  # noise-free pulls are the high-risk arm (success), random ones the low arm; with a
        # split each episode's own pair (ids 2k + 1 / 2k + 2): one pull, whichever the pair
        assert [ep.success for ep in episodes] == [not ep.random[0][0] for ep in episodes]
        assert all(len(ep.actions) == 1 for ep in episodes)
        ids = {a for ep in episodes for a in ep.actions[0]}
        assert (len(ids) > 2) if "split" in kwargs else (ids == {1, 2}), ids
    if env_name == "countdown":
        clean = [ep for ep in episodes if not ep.random[0][0]]
        assert all(ep.success for ep in clean)


def test_dataset_is_deterministic(tiny):
    _, tok = tiny
    a = build_sft_dataset("sokoban", 8, seed=3, noise=0.3, tokenizer=tok)
    b = build_sft_dataset("sokoban", 8, seed=3, noise=0.3, tokenizer=tok)
    c = build_sft_dataset("sokoban", 8, seed=4, noise=0.3, tokenizer=tok)
    assert a == b and a != c
    assert all(len(ids) == len(mask) and 0 < sum(mask) < len(ids) for ids, mask in a)


def test_lr_schedule():
    assert lr_at(0, 10, 1.0, "constant") == 1.0
    assert lr_at(0, 10, 1.0) == 1.0 and lr_at(5, 10, 1.0) == pytest.approx(0.5) and lr_at(10, 10, 1.0) == 0.0
    assert lr_at(0, 10, 1.0, warmup_steps=4) == 0.25
    with pytest.raises(ValueError, match="accepted"):
        lr_at(0, 10, 1.0, "linear")


@pytest.mark.slow
def test_twenty_steps_lower_the_loss(tiny):
    path, tok = tiny
    from fastpo.model import load_policy

    data = build_sft_dataset("frozenlake", 16, seed=11, noise=0.3, tokenizer=tok, env_kwargs=NON_SLIPPERY)
    torch.manual_seed(0)
    model = load_policy(path)
    losses = train_sft(model, data, 20, lr=1e-2, batch_size=4, micro_batch_size=2, pad_token_id=tok.pad_token_id)
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(len(tok)), rel=0.05)  # a fresh model is near uniform
    assert np.mean(losses[-3:]) < 0.6 * losses[0], losses


@pytest.mark.slow
def test_cli_trains_and_saves(tiny, tmp_path, capsys):
    path, _ = tiny
    out = tmp_path / "sft_out"
    cmd = [sys.executable, "-m", "fastpo.sft", "--model.path", str(path), "--env.names", "bandit"]
    cmd += ["--sft.episodes", "8"]
    cmd += ["--sft.steps", "3", "--sft.batch_size", "2", "--sft.log_every", "1", "--sft.save_every", "1", "--sft.out",
            str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    # snapshots after steps 1 and 2 (the end is OUT itself), each loadable and different from the final model
    from fastpo.model import load_policy

    final = load_policy(out)
    for k in (1, 2):
        snap = load_policy(out / f"step-{k}")
        assert any(not torch.equal(a, b) for a, b in zip(snap.parameters(), final.parameters(), strict=True))
    assert not (out / "step-3").exists()
    assert len((out / "sft_log.jsonl").read_text().splitlines()) == 3
    assert json.loads((out / "sft_args.json").read_text())["env"]["names"] == ["bandit"]
    # the refusals through fastpo.sft's main in this process (the run above covers the interpreter's exit status)
    from fastpo.sft import main

    capsys.readouterr()
    assert main(cmd[3:5] + ["--env.names", "chess", "--sft.out", str(out)]) == 2
    assert "env.names: unknown env 'chess'; accepted" in capsys.readouterr().err
    assert main(cmd[3:] + ["--sft.save_every", "-1", "--sft.noise", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: sft.noise must lie in [0, 1], got 2.0", "error: sft.save_every must be >= 0 (0: save only at the end), "
        "got -1"], err


def test_training_is_deterministic_given_the_seed(tiny):
    path, tok = tiny
    from fastpo.model import load_policy

    data = build_sft_dataset("bandit", 6, seed=1, noise=0.5, tokenizer=tok)
    runs = []
    for seed in (0, 0, 1):
        model = load_policy(path)
        runs.append(train_sft(model, data, 3, lr=1e-2, batch_size=2, pad_token_id=tok.pad_token_id, seed=seed))
    assert runs[0] == runs[1] and runs[0] != runs[2]
