"""fastpo.rollout.run_rollout with a scripted engine (exact rewards, penalties, masks, budgets, metrics) and one
end-to-end run with the real HFEngine on a tiny model (invariants, logprobs vs a fresh forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastpo.envs as E
from fastpo import testing
from fastpo.config import RolloutConfig
from fastpo.engine import HFEngine, SamplingParams
from fastpo.prompts import prompt_spec, render_chat
from fastpo.rollout import RolloutPart, run_rollout, run_rollouts

SOKOBAN = "######\n#_P__#\n#_X__#\n#_O__#\n#____#\n######"  # Down pushes the box onto the target: +10.9
FROZEN = ["SFFF", "FHFH", "FFFH", "HFFG"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return testing.build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_rollout"))


def _ragen_sum(values):
    acc = 0
    for v in values:
        acc += v
    return acc


#: The per-env options of a RolloutPart; the rest of a _rollout call's keywords are RolloutConfig fields.
PART_KEYS = {"max_turns", "max_actions_per_turn", "label", "prefix"}


def _rollout(tok, env, spec, script, groups=None, already_reset=True, max_new_tokens=24, stop=(), **options):
    n = env.num_envs
    engine = testing.ScriptedEngine(tok, script)
    cfg = RolloutConfig(**{k: v for k, v in options.items() if k not in PART_KEYS})
    batch = run_rollout(
        env,
        engine,
        tok,
        spec,
        np.arange(n),
        groups if groups is not None else np.arange(n),
        cfg,
        SamplingParams(max_new_tokens=max_new_tokens, stop=stop),
        list(range(n)),
        already_reset=already_reset,
        **{k: v for k, v in options.items() if k in PART_KEYS},
    )
    return batch, engine


def _check_invariants(tok, traj, engine=None, sid=None, exact_decode=True):
    """Lengths, mask = exactly the sampled tokens, logprobs aligned, sequence renders the chat."""
    t = len(traj.input_ids)
    assert len(traj.loss_mask) == len(traj.sample_logprobs) == len(traj.token_rewards) == len(traj.turn_end) == t
    assert sum(traj.loss_mask) == sum(traj.response_lengths)
    assert all(lp == (-1.0 if m else 0.0) for m, lp in zip(traj.loss_mask, traj.sample_logprobs, strict=True))
    assert sum(traj.turn_end) == traj.num_turns
    # turn ends = ends of the runs of trained tokens
    ends = [j for j in range(t) if traj.loss_mask[j] and (j + 1 == t or not traj.loss_mask[j + 1])]
    assert ends == [j for j in range(t) if traj.turn_end[j]]
    assert traj.reward == pytest.approx(sum(traj.token_rewards))
    if exact_decode:
        text = tok.decode(traj.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert text == render_chat(tok, traj.messages, for_update=True)
    if engine is not None:  # the session holds the sequence minus the closing tail
        session = engine.sessions[sid]
        assert traj.input_ids[: len(session)].tolist() == list(session)
        assert not any(traj.loss_mask[len(session) :])


def _assistant(traj):
    return [m["content"] for m in traj.messages if m["role"] == "assistant"]


def _rewards_shown(traj):
    return [m["content"] for m in traj.messages if m["role"] == "user"][1:]


def test_sokoban_valid_invalid_unparsable_length_toomany_budget(tok):
    env = E.make("sokoban", 6)
    env.reset_from_layouts([SOKOBAN] * 6)
    spec = prompt_spec("sokoban")
    lr5 = "Left || Right || Left || Right || Left"
    script = [
        ["push down</think><answer>Down</answer>"],  # valid: solved in one action
        ["a</think><answer>Left || Jump</answer>", "b</think><answer>Right</answer>", "c</think><answer>down</answer>"],
        ["I will go down", "d</think><answer>Down</answer>"],  # unparsable first
        [("length", "I think that " * 40), "e</think><answer>Up</answer>", "f</think><answer>up</answer>"],
        ["g</think><answer>Left || Right || Left || Right || Up || Jump</answer>", "h</think><answer>Down</answer>"],
        [f"i</think><answer>{lr5}</answer>", f"j</think><answer>{lr5} || Right</answer>", "never"],  # budget
    ]
    batch, engine = _rollout(tok, env, spec, script, groups=[0, 0, 0, 1, 1, 1], max_turns=3)
    tr = batch.trajectories
    for i, traj in enumerate(tr):
        _check_invariants(tok, traj, engine, sid=i)
        if i != 3:
            assert _assistant(traj) == ["<think>" + s for s in script[i][: traj.num_turns]]
        assert traj.messages[1]["content"].count("State:\n" + SOKOBAN) == 1
    # rewards: RAGEN's float sums (-0.1 per action, 10.9 for the push onto the target)
    assert [t.num_turns for t in tr] == [1, 3, 2, 3, 2, 2]
    assert [t.num_actions for t in tr] == [1, 3, 1, 2, 6, 10]
    assert [t.num_format_penalties for t in tr] == [0, 1, 1, 1, 0, 0]
    assert [t.success for t in tr] == [True, True, True, False, True, False]
    assert [t.env_done for t in tr] == [True, True, True, False, True, True]  # i5: Sokoban's max_steps=10 too
    assert [t.num_effective_actions for t in tr] == [1, 3, 1, 0, 5, 9]  # Up / Left into a wall: not effective
    assert tr[0].turn_rewards == [10.899999618530273] or tr[0].turn_rewards == [10.9]
    assert tr[1].turn_rewards == [-0.1, -0.1, 10.9] and tr[1].turn_penalties == [-0.1, 0.0, 0.0]
    assert tr[2].turn_rewards == [0, 10.9]
    assert tr[3].turn_rewards == [0, -0.1, -0.1] and tr[3].finish_reasons == ["length", "stop", "stop"]
    assert tr[4].turn_rewards == [_ragen_sum([-0.1] * 5), 10.9]
    assert tr[5].turn_rewards == [_ragen_sum([-0.1] * 5)] * 2
    expected = [10.9, 10.6, 10.8, -0.3, 10.4, -1.0]
    assert [t.reward for t in tr] == pytest.approx(expected)
    # trajectory-level: the whole reward on the last trained token
    for t in tr:
        last = max(j for j, m in enumerate(t.loss_mask) if m)
        assert t.token_rewards[last] == pytest.approx(t.reward)
        assert sum(1 for r in t.token_rewards if r != 0) == 1
    # prompts: rewards as Python prints them, the budget left, the truncated turn closed by the template
    assert _rewards_shown(tr[2])[0].startswith("Reward:\n0\n\nTurn 2:\nState:\n")
    assert "Reward:\n-0.5\n" in _rewards_shown(tr[5])[0] and "You have 5 actions left." in _rewards_shown(tr[5])[0]
    assert tr[3].response_lengths[0] == 24
    text3 = tok.decode(tr[3].input_ids, skip_special_tokens=False)
    assert "I think that I think that" in text3 and "<|im_end|>\n<|im_start|>user\nReward:\n0\n" in text3
    # the mask covers exactly the scripted tokens (+ EOS)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    want = tok.encode(script[1][0], add_special_tokens=False) + [eos]
    first_run = [x for x, m in zip(tr[1].input_ids, tr[1].loss_mask, strict=True) if m][: len(want)]
    assert first_run == want
    # metrics
    m = batch.metrics
    assert m["rollout/success"] == pytest.approx(4 / 6) and m["env/Sokoban/success"] == pytest.approx(4 / 6)
    assert m["rollout/pass@3"] == 1.0 and m["env/Sokoban/pass@3"] == 1.0
    std = (np.std(expected[:3], ddof=1) + np.std(expected[3:], ddof=1)) / 2
    assert m["rollout/in_group_std"] == pytest.approx(std)
    assert m["rollout/num_actions"] == pytest.approx(23 / 6)
    assert m["rollout/action_is_valid"] == pytest.approx((1 + 1 + 0.5 + 2 / 3 + 1 + 1) / 6)
    assert m["rollout/action_is_effective"] == pytest.approx((1 + 1 + 0.5 + 0 + 0.5 + 1) / 6)
    assert m["rollout/format_penalty_rate"] == pytest.approx(3 / 13)
    assert m["rollout/length_stop_rate"] == pytest.approx(1 / 13)
    assert m["rollout/generate_s"] >= 0 and "env/Sokoban/env_s" in m
    assert sorted(engine.closed) == list(range(6))


@pytest.mark.parametrize("penalties", [False, True])
def test_turn_level_rewards(tok, penalties):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    script = [["a</think><answer>Left || Jump</answer>", "b</think><answer>Right</answer>", "c</think><answer>Down"]]
    script[0][2] += "</answer>"
    batch, engine = _rollout(
        tok, env, prompt_spec("sokoban"), script, max_turns=3, reward_level="turn", turn_level_penalties=penalties
    )
    t = batch.trajectories[0]
    _check_invariants(tok, t, engine, 0)
    ends = [j for j, e in enumerate(t.turn_end) if e]
    want = [-0.1 + (-0.1 if penalties else 0.0), -0.1, 10.9]
    assert [t.token_rewards[j] for j in ends] == pytest.approx(want)
    assert sum(1 for r in t.token_rewards if r != 0) == 3
    assert t.reward == pytest.approx(sum(want))


def test_count_truncated_penalty(tok):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    script = [["g</think><answer>Left || Right || Left || Right || Left || Jump</answer>"]]
    batch, _ = _rollout(tok, env, prompt_spec("sokoban"), script, max_turns=1, count_truncated_penalty=True)
    assert batch.trajectories[0].turn_penalties == [-0.1] and batch.trajectories[0].num_actions == 5


def test_frozenlake_budget_hole_goal(tok):
    env = E.make("frozenlake", 3, is_slippery=False)
    env.reset_from_layouts([FROZEN] * 3)
    spec = prompt_spec("frozenlake", max_actions_per_traj=7)
    rl5 = "Right || Left || Right || Left || Right"
    script = [
        [f"x</think><answer>{rl5}</answer>", f"y</think><answer>{rl5}</answer>", "never"],  # budget cut mid-turn
        ["z</think><answer>Down || Right || Right</answer>", "never"],  # falls into the hole on action 2
        ["w</think><answer>Right || Right || Down || Down || Down</answer>", "v</think><answer>Right</answer>"],
    ]
    batch, engine = _rollout(tok, env, spec, script, max_turns=3)
    t0, t1, t2 = batch.trajectories
    for i, t in enumerate(batch.trajectories):
        _check_invariants(tok, t, engine, i)
    assert (t0.num_turns, t0.num_actions, t0.reward, t0.env_done) == (2, 7, 0.0, False)
    assert "You have 2 actions left." in _rewards_shown(t0)[0]
    assert (t1.num_turns, t1.num_actions, t1.success, t1.env_done, t1.reward) == (1, 2, False, True, 0.0)
    assert (t2.num_turns, t2.num_actions, t2.success, t2.reward) == (2, 6, True, 1.0)
    assert t2.turn_rewards == [0, 1.0]
    assert batch.metrics["env/FrozenLake/success"] == pytest.approx(1 / 3)


def test_stop_string_ends_turns_at_the_answer(tok):
    """With stop ("</answer>",) the text after the first closing tag is never sampled, so it is neither trained nor
    in the next turn's context; rewards are those of the same answers without the tail."""
    script = [
        ["x</think><answer>Right || Right</answer> Left Left</answer> qjunkq", "y</think><answer>Down</answer>qtailq"],
        ["z</think><answer>Down || Right</answer>", "never"],
        [("length", "w</think><answer>Right Right Right Right Right Right Right"), ("length", "v v v v v v v v")],
    ]
    clean = [
        ["x</think><answer>Right || Right</answer>", "y</think><answer>Down</answer>"],
        script[1],
        script[2],
    ]
    runs = []
    for sc, stop in ((script, ("</answer>",)), (clean, ())):
        env = E.make("frozenlake", 3, is_slippery=False)
        env.reset_from_layouts([FROZEN] * 3)
        runs.append(_rollout(tok, env, prompt_spec("frozenlake"), sc, max_turns=2, max_new_tokens=40, stop=stop))
    (stopped, engine), (plain, _) = runs
    for i, t in enumerate(stopped.trajectories):
        _check_invariants(tok, t, engine, i)
    t0, t1, t2 = stopped.trajectories
    assert _assistant(t0) == [
        "<think>x</think><answer>Right || Right</answer>",
        "<think>y</think><answer>Down</answer>",
    ]
    assert "qjunkq" not in tok.decode(t0.input_ids) and "qtailq" not in tok.decode(t0.input_ids)
    assert t0.finish_reasons == ["stop", "stop"] and t1.finish_reasons == ["stop"]  # t1: by the stop string
    assert t2.finish_reasons == ["length", "length"] and t2.num_format_penalties == 2
    for a, b in zip(stopped.trajectories, plain.trajectories, strict=True):
        assert (a.reward, a.num_actions, a.success) == (b.reward, b.num_actions, b.success)
        assert a.turn_rewards == b.turn_rewards
    # the stop-string turns end on the answer's closing tag, not on EOS; the EOS-ended ones keep EOS trained
    eos = engine.eos_token_ids[0]
    assert [tok.decode(r) for r in (t0.input_ids[j] for j, e in enumerate(t0.turn_end) if e)] == ["</answer>"] * 2
    assert eos in [plain.trajectories[0].input_ids[j] for j, e in enumerate(plain.trajectories[0].turn_end) if e]


def test_bandit(tok):
    env = E.make("bandit", 3)
    spec = prompt_spec("bandit")
    script = [
        ["hi</think><answer>Dragon</answer>"],
        ["lo</think><answer>phoenix</answer>"],
        ["?</think><answer>Unicorn"],
    ]
    script[2][0] += "</answer>"
    batch, engine = _rollout(tok, env, spec, script, already_reset=False, max_turns=1)
    t0, t1, t2 = batch.trajectories
    for i, t in enumerate(batch.trajectories):
        _check_invariants(tok, t, engine, i)
        assert "You are playing a bandit game." in t.messages[1]["content"]
    assert t0.success and t0.num_actions == 1 and t0.reward in (0.0, 1.0)
    assert t1.reward == pytest.approx(0.1) and not t1.success
    assert (t2.num_actions, t2.reward, t2.num_format_penalties, t2.env_done) == (0, pytest.approx(-0.1), 1, False)
    assert batch.metrics["env/Bandit/success"] == pytest.approx(1 / 3)


def test_countdown(tok):
    env = E.make("countdown", 3)
    env.reset(np.arange(3))
    sol = env.solutions()[0]
    script = [[f"s</think><answer>{sol}</answer>"], ["s</think><answer>1 + 1</answer>"], ["no answer"]]
    batch, engine = _rollout(tok, env, prompt_spec("countdown"), script, max_turns=1)
    t0, t1, t2 = batch.trajectories
    for i, t in enumerate(batch.trajectories):
        _check_invariants(tok, t, engine, i)
    assert t0.success and t0.reward == 1.0 and t0.num_actions == 1
    assert t1.reward == 0.0 and t1.num_actions == 1 and not t1.success
    assert (t2.num_actions, t2.reward) == (0, pytest.approx(-0.1))
    assert not env._terminated[2]  # the unparsable instance was never stepped


def test_canonical_mode(tok):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    script = [["  go left  </think>  <answer> left || Right|| Jump </answer>", " down </think><answer>Down</answer>"]]
    batch, engine = _rollout(tok, env, prompt_spec("sokoban"), script, max_turns=2, canonical=True)
    t = batch.trajectories[0]
    assert _assistant(t) == [
        "<think>go left</think><answer>left || Right|| Jump</answer>",
        "<think>down</think><answer>Down</answer>",
    ]
    text = tok.decode(t.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text == render_chat(tok, t.messages, for_update=True)
    assert not t.logprobs_exact and not any(t.sample_logprobs)
    assert t.reward == pytest.approx(-0.2 - 0.1 + 10.9)
    # the second prompt is the full re-rendered chat holding the canonical text (stateless generate)
    second = tok.decode(engine.prompts[1][2], skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>go left</think><answer>left || Right|| Jump</answer><|im_end|>" in second
    assert not engine.sessions
    trained = tok.decode([x for x, m in zip(t.input_ids, t.loss_mask, strict=True) if m])
    assert trained == "".join(c + "<|im_end|>" for c in _assistant(t))


def test_context_window(tok):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    script = [["a</think><answer>Left || Jump</answer>", "b</think><answer>Right</answer>"]]
    batch, engine = _rollout(tok, env, prompt_spec("sokoban"), script, max_turns=2, max_context_window=1)
    t = batch.trajectories[0]
    text = tok.decode(t.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert text == render_chat(tok, t.messages, for_update=True)
    assert sum(t.loss_mask) == t.response_lengths[-1] and sum(t.turn_end) == 1  # only the kept turn is trained
    second = tok.decode(engine.prompts[1][2], skip_special_tokens=False)
    assert "a</think>" not in second and "Turn 2:" not in second and "Turn 1:" in second
    assert _assistant(t) == ["<think>b</think><answer>Right</answer>"]
    assert t.reward == pytest.approx(-0.1 - 0.1)  # RAGEN: only the kept turn's reward, the full penalty
    assert t.logprobs_exact is False
    full, _ = _rollout(
        tok, env, prompt_spec("sokoban"), script, max_turns=2, max_context_window=1, window_reward="full"
    )
    assert full.trajectories[0].reward == pytest.approx(-0.3)


def test_train_on_observations(tok):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    batch, _ = _rollout(
        tok, env, prompt_spec("sokoban"), [["a</think><answer>Down</answer>"]], train_on_observations=True
    )
    t = batch.trajectories[0]
    system = tok.apply_chat_template(t.messages[:1], tokenize=False)
    start = len(tok.encode(system, add_special_tokens=False)) + 1
    assert t.loss_mask.tolist() == [False] * start + [True] * (len(t.input_ids) - start)
    assert t.token_rewards[-1] == pytest.approx(10.9)


def test_context_cap_ends_episode(tok):
    env = E.make("sokoban", 1)
    env.reset_from_layouts([SOKOBAN])
    script = [["a</think><answer>Left</answer>", "b</think><answer>Right</answer>"]]
    first, _ = _rollout(tok, env, prompt_spec("sokoban"), script, max_turns=1)
    cap = len(first.trajectories[0].input_ids) + 24 + 2  # the first turn fits, the second does not
    env.reset_from_layouts([SOKOBAN])
    batch, engine = _rollout(tok, env, prompt_spec("sokoban"), script, max_turns=2, max_model_len=cap)
    t = batch.trajectories[0]
    _check_invariants(tok, t, engine, 0)
    assert t.context_truncated and t.num_turns == 1 and batch.metrics["rollout/context_truncated"] == 1.0


class _CountingEngine(testing.ScriptedEngine):
    calls = 0

    def generate_sessions(self, session_ids, params, seeds=None):
        self.calls += 1
        return super().generate_sessions(session_ids, params, seeds)


def test_several_envs_in_one_engine_call_per_turn(tok):
    """run_rollouts over a Sokoban part and a FrozenLake part: one engine call per turn for both, and each part's
    trajectories and metrics are exactly those of its own run_rollout."""
    lr = "Left || Right"
    sok = [["a</think><answer>Down</answer>"],
           ["b</think><answer>Left</answer>", "c</think><answer>Right</answer>", "c</think><answer>Down</answer>"]]
    froz = [["d</think><answer>Right || Right</answer>", "e</think><answer>Down || Down || Down</answer>",
             "i</think><answer>Right</answer>"],
            [f"f</think><answer>{lr}</answer>", "g</think><answer>Up</answer>", "h</think><answer>Down</answer>"]]
    script = sok + froz

    def parts():
        s_env, f_env = E.make("sokoban", 2), E.make("frozenlake", 2, is_slippery=False)
        s_env.reset_from_layouts([SOKOBAN] * 2)
        f_env.reset_from_layouts([FROZEN] * 2)
        opts = {"already_reset": True, "max_turns": 3}
        return [RolloutPart(s_env, prompt_spec("sokoban"), [0, 0], [0, 0], [0, 1], **opts),
                RolloutPart(f_env, prompt_spec("frozenlake"), [0, 0], [1, 1], [2, 3], **opts)]

    params = SamplingParams(max_new_tokens=24)
    joint = _CountingEngine(tok, script)
    together = run_rollouts(parts(), joint, tok, params)
    alone = []
    for part in parts():
        engine = _CountingEngine(tok, script)
        alone.append((run_rollout(part.env, engine, tok, part.spec, part.seeds, part.group_ids, None, params,
                                  part.request_seeds, max_turns=part.max_turns, already_reset=True), engine.calls))
    assert joint.calls == max(calls for _, calls in alone) == 3 and sum(c for _, c in alone) == 6
    for got, (want, _) in zip(together, alone, strict=True):
        for a, b in zip(got.trajectories, want.trajectories, strict=True):
            for name in ("input_ids", "loss_mask", "token_rewards", "turn_end"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        timing = ("generate_s", "env_s", "prompt_s")
        assert {k: v for k, v in got.metrics.items() if not k.endswith(timing)} == {
            k: v for k, v in want.metrics.items() if not k.endswith(timing)}
    assert together[0].metrics["env/Sokoban/success"] == 1.0 and "env/FrozenLake/success" in together[1].metrics
    mixed = parts()
    mixed[1].request_seeds = None
    with pytest.raises(ValueError, match="request_seeds to every RolloutPart or to none"):
        run_rollouts(mixed, _CountingEngine(tok, script), tok, params)
    assert together[1].trajectories[0].success and not together[1].trajectories[1].success


def test_hf_engine_end_to_end(tok, tmp_path):
    torch.set_num_threads(1)
    model = testing.build_tiny_model(tmp_path, tok, seed=0)
    engine = HFEngine(model, tok)
    env = E.make("sokoban", 3)
    env.reset_from_layouts([SOKOBAN] * 3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    batch = run_rollout(
        env,
        engine,
        tok,
        prompt_spec("sokoban"),
        np.zeros(3),
        [0, 0, 0],
        RolloutConfig(),
        params,
        [5, 6, 7],
        max_turns=2,
        already_reset=True,
    )
    for t in batch.trajectories:
        n = len(t.input_ids)
        assert len(t.loss_mask) == len(t.sample_logprobs) == len(t.token_rewards) == len(t.turn_end) == n
        assert sum(t.loss_mask) == sum(t.response_lengths) and t.logprobs_exact
        assert t.num_turns == 2 and sum(t.turn_end) == 2  # random text never parses: two turns through the KV path
        assert all(lp == 0.0 for lp, m in zip(t.sample_logprobs, t.loss_mask, strict=True) if not m)
        with torch.no_grad():
            logits = model(torch.tensor([t.input_ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        pos = [j for j, m in enumerate(t.loss_mask) if m]
        fresh = torch.stack([logp[j - 1, t.input_ids[j]] for j in pos])
        torch.testing.assert_close(fresh, torch.tensor([t.sample_logprobs[j] for j in pos]), atol=1e-4, rtol=0)


def test_turn_state_keys(tok):
    """Each turn records the key of the state it starts from: equal for a state reached again (at another turn, or
    by another trajectory), the env's own key after the same moves; text envs hash the observation."""
    env = E.make("frozenlake", 2, is_slippery=False)
    env.reset_from_layouts([FROZEN] * 2)
    script = [["a</think><answer>Right || Left</answer>", "b</think><answer>Right</answer>"],
              ["c</think><answer>Right</answer>", "d</think><answer>Left</answer>"]]
    batch, _ = _rollout(tok, env, prompt_spec("frozenlake"), script, max_turns=2)
    (s0, s1), (r0, r1) = (t.turn_state_keys for t in batch.trajectories)
    assert s0 == s1 == r0 != r1  # instance 0 came back to the start; instance 1 moved right
    probe = E.make("frozenlake", 1, is_slippery=False, backend="python")
    probe.reset_from_layouts([FROZEN])
    assert int(probe.state_keys().view(np.int64)[0]) == s0
    probe.step(np.array([3], np.int32))
    assert int(probe.state_keys().view(np.int64)[0]) == r1
    bandit = E.make("bandit", 2)
    obs = bandit.reset(np.array([4, 4]))
    batch, _ = _rollout(tok, bandit, prompt_spec("bandit"), [["x</think><answer>Dragon</answer>"]] * 2)
    keys = [t.turn_state_keys for t in batch.trajectories]
    assert keys[0] == keys[1] == [int(E.base.text_state_keys(obs[:1]).view(np.int64)[0])]


@pytest.mark.parametrize("limit", [64 << 20, 6000], ids=["cache", "small-cache"])
@pytest.mark.parametrize("options", [
    {}, {"max_context_window": 1}, {"canonical": True}, {"train_on_observations": True},
    {"context_window_mode": "limited_multi_turn", "max_context_window": 2}, {"context_window_mode": "single_turn"},
    {"context_window_mode": "single_turn", "canonical": True},
], ids=["kv", "window", "canonical", "observations", "limited", "single", "single-canonical"])
def test_text_cache_changes_no_trajectory_and_encodes_a_text_once(tok, monkeypatch, options, limit):
    """The rollout's TextCache (prompts rendered and texts encoded while a batch is built) gives the trajectories
    built without it, field for field, and each distinct text reaches the tokenizer once per batch; a cache over
    its limit starts over (it never holds more) and still gives the same trajectories."""
    import fastpo.rollout as R
    from fastpo.chat_tokens import TextCache

    class Forgetful(dict):  # a cache that never keeps anything: every lookup misses
        def __setitem__(self, key, value):
            pass

    script = [[f"t{k}{i}</think><answer>{a}</answer>" for k, a in enumerate(("Left || Up", "Down", "Right"))]
              for i in range(4)]
    calls: list[str] = []
    caches: list[TextCache] = []

    def small() -> TextCache:
        caches.append(TextCache(limit=limit))
        return caches[-1]

    def run(cached: bool):
        env = E.make("sokoban", 4)
        env.reset_from_layouts([SOKOBAN] * 4)
        calls.clear()
        encode = tok.encode

        def counting(text, **kw):
            calls.append(text)
            return encode(text, **kw)

        with monkeypatch.context() as m:
            m.setattr(tok, "encode", counting)
            m.setattr(R, "TextCache", small if cached else lambda: TextCache(ids=Forgetful(), prompts=Forgetful()))
            batch, _ = _rollout(tok, env, prompt_spec("sokoban"), script, groups=[0, 0, 1, 1], max_turns=3, **options)
        return batch.trajectories, list(calls)

    plain, plain_calls = run(cached=False)
    cached, cached_calls = run(cached=True)
    assert all(c.size <= limit for c in caches)
    if limit > 10_000:
        assert len(cached_calls) == len(set(cached_calls)) < len(plain_calls)
    else:  # started over: some texts are encoded again (at most as often as without a cache)
        assert len(set(cached_calls)) < len(cached_calls) <= len(plain_calls)
    assert set(cached_calls) == set(plain_calls)
    for a, b in zip(plain, cached, strict=True):
        for name in ("input_ids", "loss_mask", "sample_logprobs", "token_rewards", "turn_end", "messages",
                     "sample_bounds", "step_keys", "step_rewards", "reward", "num_turns"):
            assert np.array_equal(np.asarray(getattr(a, name), dtype=object), np.asarray(getattr(b, name),
                                                                                         dtype=object)), name
        assert np.array_equal(np.asarray(a.versions), np.asarray(b.versions))
