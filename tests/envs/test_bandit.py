"""Bandit: RAGEN's prompt character for character, arm statistics, determinism per seed, names, bad input."""

import numpy as np
import pytest

import fastpo.envs
from fastpo.envs.bandit import bandit_draws
from fastpo.envs.rng import STREAM_BANDIT, CounterRng

# RAGEN ragen/env/bandit/env.py INIT_PROMPT with name_a="Phoenix", name_b="Dragon"; typed out independently
# (note the trailing spaces on lines 1, 2 and 4).
GOLDEN_PHOENIX_FIRST = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named Phoenix and Dragon\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher"
    " rewards on average? Choose between Phoenix and Dragon, and output like <answer> Phoenix </answer> or"
    " <answer> Dragon </answer>.\n"
)


def first_seed(lo_first: bool) -> int:
    return next(s for s in range(100) if bandit_draws(s)[0] == lo_first)


def pull(env, action: int):
    return env.step(np.full(env.num_envs, action, dtype=np.int32))


def test_golden_prompt_both_orders():
    env = fastpo.envs.make("bandit", 2)
    obs = env.reset(np.array([first_seed(True), first_seed(False)]))
    assert obs[0] == GOLDEN_PHOENIX_FIRST
    swapped = GOLDEN_PHOENIX_FIRST.replace("Phoenix", "\0").replace("Dragon", "Phoenix").replace("\0", "Dragon")
    assert obs[1] == swapped
    assert env.render() == obs
    assert env.instruction() == ""
    assert env.action_names == ["Phoenix", "Dragon"] and env.action_space == "discrete"
    assert env.max_actions_per_turn == 1


def test_draw_order_is_order_first_then_pull():
    seeds = np.arange(-20, 40)
    env = fastpo.envs.make("bandit", len(seeds))
    obs = env.reset(seeds)
    _, reward, *_ = pull(env, 2)
    for seed, o, r in zip(seeds.tolist(), obs, reward.tolist(), strict=True):
        rng = CounterRng(seed, STREAM_BANDIT)
        lo_first = rng.uniform() < 0.5  # RAGEN's _randomize_arms: (lo, hi) when uniform < 0.5
        pays = rng.uniform() < 0.25
        assert ("named Phoenix and Dragon" in o) == lo_first and r == float(pays)


def test_order_swap_rate_and_payout_over_10000_seeds():
    n = 10_000
    env = fastpo.envs.make("bandit", n)
    obs = env.reset(np.arange(n))
    lo_first = np.array(["named Phoenix and Dragon" in o for o in obs])
    assert all(("named Dragon and Phoenix" in o) != f for o, f in zip(obs, lo_first, strict=True))
    assert abs(lo_first.mean() - 0.5) < 3 * np.sqrt(0.25 / n)
    _, reward, terminated, truncated, info = pull(env, 2)
    assert set(np.unique(reward).tolist()) == {0.0, 1.0}
    assert abs(reward.mean() - 0.25) < 3 * np.sqrt(0.25 * 0.75 / n)
    assert terminated.all() and not truncated.any() and info["success"].all()
    # the payout draw is independent of the order draw
    assert abs(reward[lo_first].mean() - reward[~lo_first].mean()) < 4 * np.sqrt(0.1875 / (n / 4))
    env.reset(np.arange(n))
    _, reward, _, _, info = pull(env, 1)
    assert np.all(reward == np.float32(0.1)) and not info["success"].any() and info["action_is_valid"].all()


def test_deterministic_per_seed_whatever_the_batch():
    seeds = np.array([7, 123456789, -3, 2**62])
    a = fastpo.envs.make("bandit", 4)
    b = fastpo.envs.make("bandit", 6)
    obs_a = a.reset(seeds)
    obs_b = b.reset(np.array([99, seeds[3], seeds[2], 5, seeds[1], seeds[0]]))
    assert obs_a == [obs_b[5], obs_b[4], obs_b[2], obs_b[1]]
    out_a = pull(a, 2)
    out_b = pull(b, 2)
    assert out_a[0] == [out_b[0][5], out_b[0][4], out_b[0][2], out_b[0][1]]
    np.testing.assert_array_equal(out_a[1], out_b[1][[5, 4, 2, 1]])
    a.reset(seeds)
    np.testing.assert_array_equal(pull(a, 2)[1], out_a[1])


def test_step_texts_and_rewards():
    hi_pays = next(s for s in range(100) if bandit_draws(s)[1])
    hi_fails = next(s for s in range(100) if not bandit_draws(s)[1])
    env = fastpo.envs.make("bandit", 3)
    env.reset(np.array([hi_pays, hi_fails, hi_pays]))
    obs, reward, terminated, truncated, info = env.step(np.array([2, 2, 1], dtype=np.int32))
    assert obs == ["Dragon: 1.0 points", "Dragon: 0.0 points", "Phoenix: 0.1 points"]
    np.testing.assert_array_equal(reward, np.array([1.0, 0.0, 0.1], dtype=np.float32))
    assert terminated.all() and not truncated.any()
    assert info["success"].tolist() == [True, True, False]
    assert info["action_is_valid"].all() and info["action_is_effective"].all()


def test_invalid_id_ends_nothing_then_finished_is_a_noop():
    env = fastpo.envs.make("bandit", 4)
    prompts = env.reset(np.arange(4))
    obs, reward, terminated, truncated, info = env.step(np.array([0, 3, -1, 2], dtype=np.int32))
    assert obs[:3] == prompts[:3] and obs[3].startswith("Dragon: ")
    assert reward[:3].tolist() == [0.0, 0.0, 0.0]
    assert terminated.tolist() == [False, False, False, True]
    assert info["action_is_valid"].tolist() == [False, False, False, True]
    assert info["action_is_effective"].tolist() == [False, False, False, True]
    obs2, reward, terminated, truncated, info = env.step(np.array([1, 1, 2, 1], dtype=np.int32))
    assert obs2[3] == obs[3]  # finished: unchanged
    assert reward[3] == 0.0 and terminated.all() and not truncated.any()
    assert info["success"].tolist() == [False, False, True, True]  # success kept for the finished one
    assert info["action_is_valid"].tolist() == [True, True, True, False]


def test_mask_reset_keeps_the_others():
    env = fastpo.envs.make("bandit", 3)
    env.reset(np.array([1, 2, 3]))
    pull(env, 2)
    obs = env.reset(np.array([10, 20, 30]), mask=np.array([False, True, False]))
    fresh = fastpo.envs.make("bandit", 1).reset(np.array([20]))[0]
    assert obs[1] == fresh and obs[0].startswith("Dragon: ") and obs[2].startswith("Dragon: ")
    _, reward, terminated, _, info = env.step(np.array([2, 1, 2], dtype=np.int32))
    assert terminated.all() and reward[0] == 0.0 and reward[2] == 0.0 and reward[1] == np.float32(0.1)
    assert info["action_is_valid"].tolist() == [False, True, False]
    assert info["success"].tolist() == [True, False, True]


def test_test_names_and_custom_names():
    env = fastpo.envs.make("bandit", 2, names="test")
    assert env.action_names == ["Trader", "Librarian"]
    obs = env.reset(np.array([first_seed(True), first_seed(False)]))
    assert "named Trader and Librarian" in obs[0] and "named Librarian and Trader" in obs[1]
    obs, _, _, _, info = env.step(np.array([2, 1], dtype=np.int32))
    assert obs[0].startswith("Librarian: ") and obs[1] == "Trader: 0.1 points"
    assert info["success"].tolist() == [True, False]
    env = fastpo.envs.make("bandit", 1, lo_arm_name="Owl", hi_arm_name="Tiger", lo_arm_score=0.15)
    assert env.action_names == ["Owl", "Tiger"]
    env.reset(np.array([0]))
    obs, reward, *_ = pull(env, 1)
    assert obs == ["Owl: 0.15 points"] and reward[0] == np.float32(0.15)
    assert pull(env, 1)[1][0] == 0.0  # already finished
    assert fastpo.envs.make("bandit", 1, names="test", hi_arm_name="Dragon").action_names == ["Trader", "Dragon"]


def test_payout_probability_is_a_field():
    n = 200
    for prob, expected in ((0.0, 0.0), (1.0, 1.0)):
        env = fastpo.envs.make("bandit", n, hi_arm_hiscore_prob=prob)
        env.reset(np.arange(n))
        assert np.all(pull(env, 2)[1] == expected)


@pytest.mark.parametrize(
    "config",
    [
        {"arms": 3},
        {"names": "train"},
        {"lo_arm_name": "Dragon"},
        {"lo_arm_name": "dragon"},
        {"hi_arm_name": ""},
        {"hi_arm_name": " Dragon"},
        {"hi_arm_hiscore_prob": 1.5},
        {"lo_arm_score": float("nan")},
        {"lo_arm_score": "0.1"},
    ],
)
def test_bad_config(config):
    with pytest.raises(ValueError):
        fastpo.envs.make("bandit", 2, **config)


@pytest.mark.parametrize(
    "actions",
    [
        np.array([1.0, 2.0]),
        np.array([1, 2, 1], dtype=np.int32),
        [True, False],
        "1 2",
        np.array([[1, 2]]),
        np.array([1, 2**40]),
    ],
)
def test_bad_actions(actions):
    env = fastpo.envs.make("bandit", 2)
    env.reset(np.arange(2))
    with pytest.raises(ValueError):
        env.step(actions)


def test_bad_reset_input_and_step_before_reset():
    env = fastpo.envs.make("bandit", 2)
    with pytest.raises(RuntimeError, match="never reset"):
        pull(env, 1)
    with pytest.raises(ValueError):
        env.reset(np.array([0.5, 1.5]))
    with pytest.raises(ValueError):
        env.reset(np.arange(3))
    with pytest.raises(ValueError):
        env.reset(np.arange(2), mask=np.array([1, 0]))
    env.reset(np.arange(2), mask=np.array([True, False]))
    with pytest.raises(RuntimeError, match=r"\[1\]"):
        pull(env, 1)
    with pytest.raises(ValueError):
        fastpo.envs.make("bandit", 0)


# RAGEN-2's ARM_NAMES (mll-lab-nu/RAGEN ragen/env/bandit/config.py at 20daedc47558e000f7de912b060646bf2e8026bd),
# typed out for the test: split -> (low-risk, high-risk) pairs.
RAGEN2_TRAIN = [("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
                ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
                ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
                ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer")]
RAGEN2_TEST = [("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
               ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
               ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator")]


@pytest.mark.parametrize("split,pairs", [("train", RAGEN2_TRAIN), ("test", RAGEN2_TEST)])
def test_split_draws_each_episodes_pair(split, pairs):
    n = 4000
    env = fastpo.envs.make("bandit", n, split=split)
    assert env.action_names == [name for pair in pairs for name in pair]
    obs = env.reset(np.arange(n))
    counts = np.zeros(len(pairs))
    for i, text in enumerate(obs):
        k = int(CounterRng(i, STREAM_BANDIT, counter=2).uniform() * len(pairs))  # draw 3 of the seed
        lo, hi = pairs[k]
        a, b = (lo, hi) if bandit_draws(i)[0] else (hi, lo)
        assert text == GOLDEN_PHOENIX_FIRST.replace("Phoenix", "\0").replace("Dragon", b).replace("\0", a)
        counts[k] += 1
    # uniform over the pairs (3 sigma each)
    p = 1 / len(pairs)
    assert np.all(np.abs(counts / n - p) <= 3 * np.sqrt(p * (1 - p) / n)), counts
    # a pull is valid only for the episode's own arms; solve() names its high arm
    plan = np.array([s[0] for s in env.solve()], dtype=np.int32)
    other = np.where(plan > 2, 1, 3).astype(np.int32)  # an arm of another pair
    _, reward, terminated, _, info = env.step(other)
    assert not info["action_is_valid"].any() and not terminated.any() and not reward.any()
    obs, reward, terminated, _, info = env.step(plan)
    assert info["action_is_valid"].all() and info["success"].all() and terminated.all()
    k = (plan[0] - 2) // 2
    assert obs[0] == f"{pairs[k][1]}: {1.0 if bandit_draws(0)[1] else 0.0} points"


def test_split_keeps_draws_one_and_two():
    """The split adds draw 3; the arm order and payout of a seed are those without a split."""
    plain, split = fastpo.envs.make("bandit", 64), fastpo.envs.make("bandit", 64, split="train")
    plain.reset(np.arange(64))
    split.reset(np.arange(64))
    hi = np.array([s[0] for s in split.solve()], dtype=np.int32)
    assert np.array_equal(plain.step(np.full(64, 2, np.int32))[1], split.step(hi)[1])


@pytest.mark.parametrize("config,message", [
    ({"split": "val"}, r"^split must be one of \['test', 'train'\] or None, got 'val'$"),
    ({"split": "train", "names": "test"}, r"^split='train' draws the arm names; drop names"),
    ({"split": "test", "hi_arm_name": "Dragon"}, r"^split='test' draws the arm names"),
])
def test_bad_split(config, message):
    with pytest.raises(ValueError, match=message):
        fastpo.envs.make("bandit", 2, **config)
