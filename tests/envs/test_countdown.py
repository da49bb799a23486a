"""Countdown: generated instances are solvable (brute force), reward cases, a safe evaluator, data files."""

import builtins
import collections
import json

import numpy as np
import pytest

import fastpo.envs
from fastpo.envs.countdown import CountdownConfig, generate_instance, ragen_has_solution, score_equation
from fastpo.envs.expr import ExprError, evaluate, parse


def brute_force_solve(nums: list[int], target: int) -> str | None:
    """An equation over all of ``nums`` (each once; + - * /, any intermediate value) equal to ``target``,
    or None. Searches with floats; the caller checks the answer exactly."""

    def search(items):
        if len(items) == 1:
            return items[0][1] if abs(items[0][0] - target) < 1e-6 else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = [it for k, it in enumerate(items) if k not in (i, j)]
                options = [(a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"), (b - a, f"({eb} - {ea})")]
                options.append((a * b, f"({ea} * {eb})"))
                options += [(a / b, f"({ea} / {eb})")] if b else []
                options += [(b / a, f"({eb} / {ea})")] if a else []
                for option in options:
                    found = search([*rest, option])
                    if found is not None:
                        return found
        return None

    return search([(float(n), str(n)) for n in nums])


def test_brute_force_solver_says_no_when_there_is_no_solution():
    assert brute_force_solve([1, 1, 1], 100) is None
    assert brute_force_solve([2, 3], 7) is None
    assert brute_force_solve([2, 3, 4], 20) == "(4 * (2 + 3))"


def test_every_generated_instance_over_5000_seeds_is_solvable():
    cfg = CountdownConfig()
    counts = collections.Counter()
    for seed in range(5000):
        target, nums, solution = generate_instance(seed, cfg)
        assert type(target) is int and cfg.min_target <= target <= cfg.max_target, (seed, target)
        assert len(nums) in (3, 4) and all(type(n) is int and 1 <= n <= 99 for n in nums), (seed, nums)
        assert score_equation(solution, target, nums) == 1.0, (seed, solution)
        found = brute_force_solve(nums, target)
        assert found is not None and score_equation(found, target, nums) == 1.0, (seed, nums, target, found)
        counts[len(nums)] += 1
    assert abs(counts[3] / 5000 - 0.5) < 3 * np.sqrt(0.25 / 5000)  # num_counts drawn uniformly


def test_generation_is_deterministic_and_follows_the_config():
    assert [generate_instance(s) for s in (0, 5, -9)] == [generate_instance(s) for s in (0, 5, -9)]
    assert generate_instance(0) != generate_instance(1)
    cfg = CountdownConfig(num_counts=(2,), min_num=5, max_num=9, min_target=20, max_target=30)
    for seed in range(200):
        target, nums, solution = generate_instance(seed, cfg)
        assert len(nums) == 2 and all(5 <= n <= 9 for n in nums) and 20 <= target <= 30
        assert score_equation(solution, target, nums, cfg) == 1.0
    impossible = CountdownConfig(num_counts=(2,), min_num=1, max_num=1, min_target=50, max_target=60)
    with pytest.raises(RuntimeError, match="seed 3"):
        generate_instance(3, impossible)


def test_env_batch_api_and_determinism():
    env = fastpo.envs.make("countdown", 3)
    assert env.action_space == "text" and env.action_names == [] and env.max_actions_per_turn == 1
    assert env.instruction().startswith("You are solving the Countdown puzzle.")
    obs = env.reset(np.array([11, 12, 13]))
    target, nums, _ = generate_instance(12)
    assert obs[1] == f"Target: {target}, nums: {nums}"
    other = fastpo.envs.make("countdown", 1)
    assert other.reset(np.array([12])) == [obs[1]]
    solutions = env.solutions()
    obs, reward, terminated, truncated, info = env.step([solutions[0], "1 + 2", "(" + solutions[2] + ")"])
    assert obs == ["Your answer get 1 points.", "Your answer get 0 points.", "Your answer get 1 points."]
    np.testing.assert_array_equal(reward, np.array([1.0, 0.0, 1.0], dtype=np.float32))
    assert terminated.all() and not truncated.any()
    assert info["success"].tolist() == [True, False, True]
    assert info["action_is_effective"].tolist() == [True, False, True]
    assert info["action_is_valid"].all()
    # one action ends the episode: the next step is a no-op
    obs2, reward, terminated, _, info = env.step([solutions[0]] * 3)
    assert obs2 == obs and not reward.any() and terminated.all() and not info["action_is_valid"].any()
    assert info["success"].tolist() == [True, False, True]


NUMS, TARGET = [3, 5, 2], 4


@pytest.mark.parametrize(
    "equation, expected",
    [
        ("2 + 5 - 3", 1.0),
        ("5 - 3 + 2", 1.0),
        ("(5 - 3) * 2", 1.0),
        (" \n2+5-3\t", 1.0),
        ("-3 + 5 * 2", 0.1),  # right numbers, wrong value
        ("-3 + 5 + 2", 1.0),
        ("3 * 5 * 2", 0.1),
        ("3 / (5 - 5) + 2", 0.0),  # 5 twice, 2 once, 3 once: not the given multiset
        ("2 + 5 - 3 - 3", 0.0),  # reused number
        ("2 + 5", 0.0),  # a number left out
        ("2 + 5 - 4", 0.0),  # another number
        ("2 + 5 - 3.0", 0.0),  # a decimal is another number
        ("2 + 5 - 03", 0.0),
        ("2 + 5 - 3 = 4", 0.0),  # not an expression
        ("2 ** 5 - 3", 0.0),
        ("2 // 5 - 3", 0.0),
        ("2 + 5 -", 0.0),
        ("(2 + 5 - 3", 0.0),
        ("", 0.0),
        ("two plus five minus three", 0.0),
        ("2 × 5 − 3", 0.0),  # unicode operators
        ("２ + ５ - ３", 0.0),  # full-width digits
        ("٢ + ٥ - ٣", 0.0),  # Arabic-Indic digits
        ("2 + 5 - 3 🙂", 0.0),
        ("__import__('os').system('echo 1')", 0.0),
        ("[2 + 5 - 3][0]", 0.0),
    ],
)
def test_reward_cases(equation, expected):
    assert score_equation(equation, TARGET, NUMS) == expected


def test_division_by_zero_and_exact_fractions():
    assert score_equation("5 / (3 - 3)", 5, [3, 3, 5]) == 0.1
    assert score_equation("1 / 3 * 3", 1, [1, 3, 3]) == 1.0  # exact, not 0.9999...
    assert score_equation("(6 - 2) / 8", 1, [6, 2, 8]) == 0.1  # 1/2 is not 1
    assert score_equation("- - 5 + 3 + 2", 10, [5, 3, 2]) == 1.0


def test_huge_and_deeply_nested_input_is_rejected_cheaply():
    assert score_equation("1+" * 100_000 + "1", 4, NUMS) == 0.0
    assert score_equation("(" * 10_000 + "2" + ")" * 10_000 + "+5-3", TARGET, NUMS) == 0.0
    deep = "(" * 40 + "2" + ")" * 40 + "+5-3"  # short enough, too deep
    assert score_equation(deep, TARGET, NUMS) == 0.0
    assert score_equation("-" * 40 + "2+5-3", TARGET, NUMS) == 0.0
    shallow = "(" * 20 + "2" + ")" * 20 + "+5-3"
    assert score_equation(shallow, TARGET, NUMS) == 1.0
    assert score_equation("9" * 5000, TARGET, NUMS) == 0.0
    with pytest.raises(ExprError, match="deeper"):
        parse(deep)
    long_chain = "+".join(["1"] * 250)  # 499 characters: parsed, and evaluated without recursion limits
    assert evaluate(parse(long_chain)) == 250


def test_evaluator_never_calls_eval_or_exec(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec/compile called")

    for name in ("eval", "exec", "compile", "__import__"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert score_equation("__import__('os').system('echo pwned')", TARGET, NUMS) == 0.0
    assert score_equation("(5 - 3) * 2", TARGET, NUMS) == 1.0
    assert score_equation("3 * 5 * 2", TARGET, NUMS) == 0.1


def test_data_path_rows_and_ragen_selection(tmp_path):
    path = tmp_path / "countdown.jsonl"
    rows = [
        {"target": 4, "nums": [3, 5, 2]},  # 5 + 2 - 3: kept
        {"target": 30, "nums": [3, 5, 2]},  # needs *: RAGEN's +/- check drops it
        {"target": 8, "nums": [1, 3, 4]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    env = fastpo.envs.make("countdown", 3, data_path=str(path))
    row0, row2 = "Target: 4, nums: [3, 5, 2]", "Target: 8, nums: [1, 3, 4]"
    assert env.reset(np.array([0, 1, 5])) == [row0, row2, row2]  # row seed % 2 of the 2 kept rows
    assert env.solutions() == [None, None, None]
    reward = env.step(["5 + 2 - 3", "1 + 3 + 4", "1 * 3 + 4"])[1]
    np.testing.assert_array_equal(reward, np.array([1.0, 1.0, 0.1], dtype=np.float32))
    env = fastpo.envs.make("countdown", 2, data_path=str(path), ragen_filter=False)
    assert env.reset(np.array([1, 2]))[0] == "Target: 30, nums: [3, 5, 2]"
    env = fastpo.envs.make("countdown", 2, data_path=str(path), ragen_filter=False, max_instances=1)
    assert env.reset(np.array([1, 2])) == ["Target: 4, nums: [3, 5, 2]"] * 2
    assert ragen_has_solution([3, 5, 2], 4) and not ragen_has_solution([3, 5, 2], 30)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"target": 4, "nums": [3, 5, 2]}\n{"target": 4, "nums": [3, 5\n', r"countdown.jsonl:2"),
        ('{"target": 4, "nums": [3, 5, 2]}\n{"target": "4", "nums": [3]}\n', r"countdown.jsonl:2"),
        ('{"target": 4}\n', r"countdown.jsonl:1"),
        ("[1, 2]\n", r"countdown.jsonl\[0\]"),
        ("\n\n", "no records"),
        ('{"target": 30, "nums": [3, 5, 2]}\n', "no row is left"),
    ],
)
def test_bad_data_files(tmp_path, content, match):
    path = tmp_path / "countdown.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        fastpo.envs.make("countdown", 1, data_path=str(path))


def test_missing_file_and_bad_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        fastpo.envs.make("countdown", 1, data_path=str(tmp_path / "nope.jsonl"))
    for config in (
        {"train_path": "x"},
        {"num_counts": (1,)},
        {"num_counts": ()},
        {"min_num": 0},
        {"min_target": 10, "max_target": 5},
        {"max_len": 0},
        {"score": "1"},
    ):
        with pytest.raises(ValueError):
            fastpo.envs.make("countdown", 1, **config)


@pytest.mark.parametrize("actions", [["1 + 2"], ["1", 2], "1 + 2 3", np.array(["1", "2"]), None])
def test_bad_actions(actions):
    env = fastpo.envs.make("countdown", 2)
    env.reset(np.arange(2))
    with pytest.raises(ValueError):
        env.step(actions)


def test_ragen_filter_agrees_with_all_sign_patterns_and_long_rows_load(tmp_path):
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(300):
        nums = [int(v) for v in rng.integers(1, 100, rng.integers(1, 8))]
        target = int(rng.integers(-50, 300))
        patterns = itertools.product((1, -1), repeat=len(nums))
        want = any(sum(s * n for s, n in zip(signs, nums, strict=True)) == target for signs in patterns)
        assert ragen_has_solution(nums, target) == want, (nums, target)
    # 40 numbers: 2^40 sign patterns, but at most 2 * 40 * 99 + 1 distinct sums
    path = tmp_path / "countdown.jsonl"
    path.write_text(json.dumps({"target": 40, "nums": [1] * 40}) + "\n" + json.dumps({"target": 41, "nums": [1] * 40}))
    env = fastpo.envs.make("countdown", 1, data_path=str(path))
    assert env.reset(np.array([1])) == [f"Target: 40, nums: {[1] * 40}"]  # 41 = +-1 x 40 is odd: dropped
    # many large numbers: every sign pattern is a distinct sum; refused by name instead of exploding
    path.write_text(json.dumps({"target": 1, "nums": [2**k for k in range(40)]}) + "\n")
    with pytest.raises(ValueError, match=r"40 numbers.*ragen_filter=False"):
        fastpo.envs.make("countdown", 1, data_path=str(path))


@pytest.mark.parametrize("max_len", [512, 5000, 100_000])
def test_a_number_past_the_int_digit_limit_scores_zero(max_len):
    cfg = CountdownConfig(max_len=max_len)
    for digits in (4000, 4400, 60_000):
        answer = "1" * digits + " + 3 + 5"
        assert score_equation(answer, TARGET, NUMS, cfg) == 0.0
    assert score_equation("(5 - 3) * 2", TARGET, NUMS, cfg) == 1.0
