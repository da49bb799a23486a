"""rollout.context_window_mode (RAGEN-2's agent_proxy.context_window_mode): the per-turn prompts of
limited_multi_turn and single_turn (exact text), their training sequences and loss masks, grpo counting each episode
once, the built-in engine's tokens equal to a fresh generation of the same prompt, the async driver equal to the
lock-step one, config errors, and short training runs with the tiny agent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastpo.envs as E
from fastpo import testing, update
from fastpo.config import AlgorithmConfig, ConfigError, RolloutConfig
from fastpo.engine import HFEngine, SamplingParams
from fastpo.preflight import validate
from fastpo.presets import get_preset
from fastpo.prompts import SYSTEM_PROMPT, Turn, build_messages, prompt_spec, render_chat, turn_messages
from fastpo.rollout import RolloutPart, Trajectory, mix_seed, run_rollout, run_rollouts

SOKOBAN = "######\n#_P__#\n#_X__#\n#_O__#\n#____#\n######"
SCRIPT = [["a</think><answer>Left</answer>", "b</think><answer>Right</answer>", "c</think><answer>Down</answer>"]]
MODES = ("limited_multi_turn", "single_turn")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return testing.build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_ctx"))


def _turns(n: int, last_response: bool = False) -> list[Turn]:
    """n turns of a hand-built episode; all but the last answered and rewarded."""
    turns = [Turn(f"S{k}", actions_left=10 - k, response=f"<think>t{k}</think><answer>A{k}</answer>", reward=-0.1 * k)
             for k in range(n)]
    if not last_response:
        turns[-1].response = turns[-1].reward = None
    return turns


def test_limited_multi_turn_prompt_text():
    spec = prompt_spec("sokoban")
    block = spec.turn_block
    msgs = turn_messages(spec, _turns(4), "limited_multi_turn", max_context_window=2)
    assert msgs == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": spec.prefix() + "\nTurn 3:\n" + block("S2", 8)},
        {"role": "assistant", "content": "<think>t2</think><answer>A2</answer>"},
        {"role": "user", "content": "Reward:\n-0.2\n" + "\nTurn 4:\n" + block("S3", 7)},
    ]
    # k = -1: every turn, numbered from 1; the chat then equals the full mode's prompt
    turns = _turns(3)
    assert turn_messages(spec, turns, "limited_multi_turn", -1) == build_messages(spec, turns)
    # k = 1: the current turn only, still numbered as in the episode
    assert turn_messages(spec, turns, "limited_multi_turn", 1) == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": spec.prefix() + "\nTurn 3:\n" + block("S2", 8)}]
    train = turn_messages(spec, _turns(3, last_response=True), "limited_multi_turn", 2, with_response=True)
    assert train[-1] == {"role": "assistant", "content": "<think>t2</think><answer>A2</answer>"}
    assert train[-2]["content"].endswith("\nTurn 3:\n" + block("S2", 8))  # no reward after the trained answer


def test_single_turn_prompt_text():
    spec = prompt_spec("sokoban")
    block = spec.turn_block
    msgs = turn_messages(spec, _turns(4), "single_turn", max_context_window=3)
    history = ("Summary: 3 step(s) completed so far. Showing the last 2 turn(s) with state/action/reward details. "
               "Recent turns:\n---\n"
               "Turn 2 State:\nS1\nTurn 2 Action: <think>t1</think><answer>A1</answer>\nTurn 2 Reward: -0.1\n---\n"
               "Turn 3 State:\nS2\nTurn 3 Action: <think>t2</think><answer>A2</answer>\nTurn 3 Reward: -0.2\n---\n")
    assert msgs == [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": spec.prefix() + "\n" + history + "\nCurrent Turn (Turn 4):\n"
                     + block("S3", 7)}]
    first = turn_messages(spec, _turns(1), "single_turn", -1)  # no history: no summary, no "Current Turn"
    assert first[1]["content"] == spec.prefix() + "\n(Turn 1):\n" + block("S0", 10)
    one = turn_messages(spec, _turns(3), "single_turn", 1)  # k = 1: no history at any turn
    assert one[1]["content"] == spec.prefix() + "\n(Turn 3):\n" + block("S2", 8)
    every = turn_messages(spec, _turns(3), "single_turn", -1)[1]["content"]
    assert "Showing the last 2 turn(s)" in every and "Turn 1 State:\nS0\n" in every
    train = turn_messages(spec, _turns(2, last_response=True), "single_turn", 2, with_response=True)
    assert [m["role"] for m in train] == ["system", "user", "assistant"]
    assert train[2]["content"] == "<think>t1</think><answer>A1</answer>"


def test_turn_messages_bad_input():
    spec = prompt_spec("sokoban")
    with pytest.raises(ValueError, match="mode must be one of limited_multi_turn, single_turn, got 'full'"):
        turn_messages(spec, _turns(2), "full")
    with pytest.raises(ValueError, match=r"turns\[0\] has no response"):
        turn_messages(spec, [Turn("S0", 10), Turn("S1", 9)], "single_turn")
    with pytest.raises(ValueError, match="the current turn has no response"):
        turn_messages(spec, _turns(2), "single_turn", with_response=True)


def _scripted(tok, mode, window=2, canonical=False, max_turns=3, driver="lockstep"):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    engine = testing.ScriptedEngine(tok, SCRIPT)
    cfg = RolloutConfig(context_window_mode=mode, max_context_window=window, canonical=canonical, mode=driver)
    batch = run_rollout(env, engine, tok, prompt_spec("sokoban"), [0], [0], cfg, SamplingParams(max_new_tokens=24),
                        [0], already_reset=True, max_turns=max_turns)
    return batch.trajectories[0], engine


@pytest.mark.parametrize("mode", MODES)
def test_prompts_and_training_sequences(tok, mode):
    t, engine = _scripted(tok, mode)
    spec = prompt_spec("sokoban")
    assert t.num_turns == 3 and t.sample_bounds.tolist()[0] == 0 and len(t.sample_bounds) == 4
    ret = -0.1 + -0.1 + 10.9  # Left, Right (back), Down (box on target)
    assert t.reward == pytest.approx(ret) and t.logprobs_exact
    assert not engine.sessions  # every prompt tokenized in full and sent as a fresh request: no session extended
    samples, rows = update.turn_samples([t], [0])
    assert rows == [0, 1, 2] and [s.turn for s in samples] == [0, 1, 2] and all(s.episode == 0 for s in samples)
    for k, s in enumerate(samples):
        _, turn, prompt = engine.prompts[k]
        assert turn == k
        answer = engine.tokenizer.encode(SCRIPT[0][k], add_special_tokens=False) + list(engine.eos_token_ids)
        assert s.input_ids.tolist() == prompt + answer  # the prompt it was generated from, then its answer
        assert s.loss_mask.tolist() == [False] * len(prompt) + [True] * len(answer)  # only the answer trains
        assert s.sample_logprobs.tolist() == [0.0] * len(prompt) + [-1.0] * len(answer)
        assert s.turn_end.tolist() == [False] * (len(s.input_ids) - 1) + [True]
        assert s.token_rewards[-1] == pytest.approx(ret) and s.token_rewards[:-1].sum() == 0  # the episode's return
        assert s.reward == t.reward and s.sample_bounds is None and len(s.step_keys) == 1
    answered = [m["content"] for m in t.messages if m["role"] == "assistant"]
    assert answered[-1] == "<think>c</think><answer>Down</answer>"  # messages: every sequence's chat, in order
    # the prompt of turn 3 (index 2) is the mode's chat over the history replayed on the env, character-exact
    text = tok.decode(engine.prompts[2][2], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    history = [Turn(*row) for row in _history()]
    assert text == render_chat(tok, turn_messages(spec, history, mode, 2), True)
    if mode == "limited_multi_turn":
        assert "Turn 1:" not in text and "\nTurn 2:\n" in text and "\nTurn 3:\n" in text
        assert "<think>b</think><answer>Right</answer>" in text and "a</think>" not in text
    else:
        assert text.count("<|im_start|>") == 3  # system, user, the generation header
        assert "Current Turn (Turn 3):" in text and "Turn 2 Action: <think>b</think><answer>Right</answer>" in text
        assert "Turn 1 State" not in text
    again, _ = _scripted(tok, mode, driver="async")  # the async driver sends the same prompts, builds the same rows
    assert again.input_ids.tolist() == t.input_ids.tolist() and again.sample_bounds.tolist() == t.sample_bounds.tolist()


def _history():
    """The (state, actions_left, response, reward) of turns 1..3 as the rollout saw them, replayed on the env."""
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    rows, left = [], 10
    for k, act in enumerate((3, 4, None)):
        state = env.render()[0]
        if act is None:
            rows.append((state, left, None, None))
            break
        _, reward, *_ = env.step(np.array([act], dtype=np.int32), render=False)
        rows.append((state, left, "<think>" + SCRIPT[0][k], float(str(np.float32(reward[0])))))
        left -= 1
    return rows


@pytest.mark.parametrize("mode", MODES)
def test_canonical_sequences_train_the_last_answer_only(tok, mode):
    t, _ = _scripted(tok, mode, canonical=True)
    assert not t.logprobs_exact
    samples, _ = update.turn_samples([t], [0])
    for k, s in enumerate(samples):
        trained = tok.decode(s.input_ids[s.loss_mask].tolist(), skip_special_tokens=False)
        assert trained == "<think>" + SCRIPT[0][k] + "<|im_end|>"  # the canonical message and its end-of-turn
        assert s.sample_logprobs.sum() == 0.0


def test_turn_samples_passes_full_episodes_through():
    full = Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1])
    out, rows = update.turn_samples([full], [0])
    assert out[0] is full and rows == [0]
    with pytest.raises(ValueError, match="sample_bounds must rise from 0 to 3"):
        Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], sample_bounds=[0, 2])


def test_grpo_counts_each_episode_once():
    """Group 0: episode A (3 turns, return 1) and B (1 turn, return 0); group 1: C and D (1 turn each). Per-turn
    rows weighted by turn count would give mean 0.75; RAGEN-2 counts each episode once: mean 0.5."""
    def episode(reward, turns, group):
        ids = [5, 6] * turns
        return Trajectory(input_ids=ids, loss_mask=[0, 1] * turns, group=group, reward=reward,
                          sample_bounds=list(range(0, 2 * turns + 1, 2)))

    eps = [episode(1.0, 3, 0), episode(0.0, 1, 0), episode(2.0, 1, 1), episode(0.0, 1, 1)]
    samples, rows = update.turn_samples(eps, [0, 1, 2, 3])
    adv, ret, _ = update.advantages(samples, rows, AlgorithmConfig(adv_estimator="grpo"), False)
    std0 = float(np.std([1.0, 0.0], ddof=1))
    std1 = float(np.std([2.0, 0.0], ddof=1))
    want = [0.5 / (std0 + 1e-6)] * 3 + [-0.5 / (std0 + 1e-6), 1.0 / (std1 + 1e-6), -1.0 / (std1 + 1e-6)]
    assert ret is None
    for a, w, s in zip(adv, want, samples, strict=True):
        np.testing.assert_allclose(a, np.where(s.loss_mask, w, 0.0), rtol=1e-5)
    # a copy of a row (batch_adjust_mode copy) does not count its episode twice
    again, _, _ = update.advantages(samples, [*rows, 3], AlgorithmConfig(adv_estimator="grpo"), False)
    np.testing.assert_allclose(again[3], adv[3], rtol=1e-6)
    np.testing.assert_allclose(again[-1], adv[3], rtol=1e-6)


def _hf_rollout(tok, model, mode, driver, seeds=(11, 12)):
    engine = HFEngine(model, tok)
    env = E.make("sokoban", len(seeds))
    env.reset_from_layouts([SOKOBAN] * len(seeds))
    cfg = RolloutConfig(context_window_mode=mode, max_context_window=2, mode=driver)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    part = RolloutPart(env, prompt_spec("sokoban"), [0] * len(seeds), [0] * len(seeds), list(seeds), max_turns=3,
                       already_reset=True)
    return run_rollouts([part], engine, tok, params, cfg)[0], engine, params


@pytest.mark.parametrize("mode", MODES)
def test_engine_tokens_equal_a_fresh_generation(tok, tmp_path, mode):
    """The built-in engine under a per-turn mode: turn k's tokens are those a fresh engine samples from the same
    prompt with the same seed (no stale KV from the previous turn); logprobs match a full forward; the async
    driver gives the same trajectories."""
    torch.set_num_threads(1)
    model = testing.build_tiny_model(tmp_path, tok, seed=0)
    batch, _, params = _hf_rollout(tok, model, mode, "lockstep")
    fresh = HFEngine(model, tok)
    for i, t in enumerate(batch.trajectories):
        assert t.num_turns == 3  # random text never parses: three turns
        for k, s in enumerate(update.turn_samples([t], [0])[0]):
            prompt = s.input_ids[~s.loss_mask].tolist()
            sampled = s.input_ids[s.loss_mask].tolist()
            again = fresh.generate([prompt], params, [mix_seed((11, 12)[i], k)])[0]
            assert again.token_ids == sampled
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([s.input_ids.tolist()])).logits[0].float(), -1)
            pos = np.flatnonzero(s.loss_mask)
            torch.testing.assert_close(torch.stack([logp[j - 1, s.input_ids[j]] for j in pos]),
                                       torch.from_numpy(s.sample_logprobs[pos]), atol=1e-4, rtol=0)
    async_batch, _, _ = _hf_rollout(tok, model, mode, "async")
    for a, b in zip(batch.trajectories, async_batch.trajectories, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.sample_bounds.tolist() == b.sample_bounds.tolist()


@pytest.mark.parametrize("field, value, message", [
    ("context_window_mode", "sliding", "rollout.context_window_mode"),
    ("reward_level", "turn", "rollout.reward_level=turn needs rollout.context_window_mode=full, got single_turn"),
    ("train_on_observations", True,
     "rollout.train_on_observations=true needs rollout.context_window_mode=full, got single_turn"),
])
def test_config_errors(field, value, message):
    cfg = get_preset("tiny")
    cfg.rollout.context_window_mode = "single_turn"
    setattr(cfg.rollout, field, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("section, field, value, message", [
    ("algorithm", "adv_estimator", "gigpo", "algorithm.adv_estimator=gigpo needs rollout.context_window_mode full"),
    ("algorithm", "rollout_filter_metric", "entropy",
     "algorithm.rollout_filter_metric=entropy needs rollout.context_window_mode full, got limited_multi_turn"),
    ("trainer", "collapse_every", 5, "trainer.collapse_every=5 needs rollout.context_window_mode full"),
])
def test_cross_section_errors(section, field, value, message):
    cfg = get_preset("tiny")
    cfg.rollout.context_window_mode = "limited_multi_turn"
    if field == "rollout_filter_metric":
        cfg.algorithm.rollout_filter_strategy = "top_p"
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_window_range_is_checked():
    cfg = get_preset("tiny")
    cfg.rollout.context_window_mode = "single_turn"
    cfg.rollout.max_context_window = 0
    with pytest.raises(ConfigError, match="rollout.max_context_window must be -1 or >= 1, got 0"):
        validate(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("mode, estimator, extra", [
    ("single_turn", "grpo", []), ("limited_multi_turn", "gae", []),
    ("limited_multi_turn", "grpo", ["--rollout.mode", "async", "--rollout.partial", "true"])])
def test_tiny_agent_trains_in_each_mode(tmp_path, mode, estimator, extra):
    """Two iterations of the shrunk tiny preset (lock-step, and partial rollouts on the async driver): the update
    trains on per-turn sequences (more rows than episodes), the trainer's logprobs equal the engine's, the
    gradient is not zero, and the metrics are finite."""
    from test_trainer import train_iterations

    from fastpo.config_load import parse_args

    small = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.env_groups", "2",
             "--env.group_size", "2", "--optim.mini_batch_size", "4", "--optim.micro_batch_tokens", "800",
             "--rollout.max_model_len", "800", "--trainer.iterations", "2", "--trainer.val_before_train", "false",
             "--trainer.val_every", "0", "--trainer.save_every", "0", "--rollout.context_window_mode", mode,
             "--rollout.max_context_window", "1", "--algorithm.adv_estimator", estimator,
             "--trainer.run_dir", str(tmp_path / mode), *extra]
    cfg = validate(parse_args(small), 1)
    rows, _ = train_iterations(cfg, 2)
    for m in rows:
        assert m["rollout/kept_turn_sequences"] >= m["rollout/kept_trajectories"] >= 1
        assert all(np.isfinite(v) for v in m.values() if isinstance(v, float))
        # the trainer's logprobs of the per-turn sequences are the engine's: the sequences are what it was prompted
        # with (a sequence built from another context would differ by far more)
        assert m["rollout/logprob_gap_max"] < 1e-3
        assert m["actor/grad_norm"] > 0
    assert any(m["rollout/kept_turn_sequences"] > m["rollout/kept_trajectories"] for m in rows)


@pytest.mark.parametrize("mode", MODES)
def test_preflight_first_prompt_is_the_rollout_s(tok, mode):
    """The prompt-fit check measures the first prompt the rollout sends under the mode."""
    from fastpo.preflight import first_prompt_len

    env = E.make("sokoban", 1)
    engine = testing.ScriptedEngine(tok, [["a</think><answer>Left</answer>"]])
    run_rollout(env, engine, tok, prompt_spec("sokoban"), [7], [0], RolloutConfig(context_window_mode=mode),
                SamplingParams(max_new_tokens=24), [0], max_turns=1)
    assert first_prompt_len(tok, "sokoban", 7, context_window_mode=mode) == len(engine.prompts[0][2])
    assert first_prompt_len(tok, "sokoban", 7) != len(engine.prompts[0][2]) or mode == "limited_multi_turn"
