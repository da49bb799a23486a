"""QA: question choice by the counter RNG, exact-match normalisation, 1/2^attempt, budget, data files."""

import json

import numpy as np
import pytest

import fastpo.envs
from fastpo.envs.qa import normalize_answer
from fastpo.envs.rng import STREAM_QA, CounterRng

ITEMS = [
    {"question": "What is 6 * 7?", "answer": "42"},
    {"question": "Capital of France?", "answer": "Paris"},
    {"question": "Solve x + 1 = 6.", "answer": "x = 5"},
    {"question": "Half of 1?", "answer": 0.5},
    {"question": "Ten?", "answer": 10},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "qa.jsonl", ITEMS)


def answer_of(seed: int) -> str:
    return str(ITEMS[CounterRng(seed, STREAM_QA).randint(len(ITEMS))]["answer"])


def test_reset_picks_the_counter_rng_item_and_covers_the_file(data):
    seeds = np.arange(200)
    env = fastpo.envs.make("qa", 200, data_path=data)
    obs = env.reset(seeds)
    expected = [ITEMS[CounterRng(int(s), STREAM_QA).randint(len(ITEMS))]["question"] for s in seeds]
    assert obs == expected
    assert {o for o in obs} == {item["question"] for item in ITEMS}
    assert env.answers()[:3] == [normalize_answer(answer_of(s)) for s in range(3)]
    assert env.instruction() == "You are solving Math problems. "
    assert env.action_space == "text" and env.max_actions_per_turn == 1 and env.max_steps == 1
    assert fastpo.envs.make("qa", 1, data_path=data).reset(np.array([77])) == [obs[77]]


def test_normalisation():
    assert normalize_answer("  X = 5 \n") == "x=5"
    assert normalize_answer("P a\tR\u00a0I s") == "paris"  # every kind of whitespace, as re's \s
    assert normalize_answer("") == ""


@pytest.mark.parametrize(
    "given, correct",
    [("42", True), (" 4 2 ", True), ("42.0", False), ("PARIS", True), ("x=5", True), ("X =\n5", True), ("", False)],
)
def test_exact_match(tmp_path, given, correct):
    labels = {"42": "42", "PARIS": "Paris", "x=5": "x = 5", "X =\n5": "x = 5", " 4 2 ": "42", "42.0": "42", "": "0"}
    path = write_jsonl(tmp_path / "one.jsonl", [{"question": "q", "answer": labels[given]}])
    env = fastpo.envs.make("qa", 1, data_path=path)
    env.reset(np.array([0]))
    obs, reward, terminated, truncated, info = env.step([given])
    assert obs == ["Correct!" if correct else "Incorrect. Please think again."]
    assert reward[0] == (1.0 if correct else 0.0) and terminated[0] == correct and truncated[0] != correct
    assert info["success"][0] == correct and info["action_is_effective"][0] == correct
    assert info["action_is_valid"][0] == (normalize_answer(given) != "")


def test_reward_halves_per_attempt_and_budget_truncates(data):
    env = fastpo.envs.make("qa", 4, data_path=data, max_attempts=3)
    env.reset(np.arange(4))
    right = [answer_of(s) for s in range(4)]
    wrong = "no idea"
    steps = [
        [right[0], wrong, wrong, wrong],
        [right[0], right[1], wrong, wrong],
        [right[0], right[1], right[2], wrong],
    ]
    rewards, terms, truncs = [], [], []
    for actions in steps:
        _, reward, terminated, truncated, info = env.step(actions)
        rewards.append(reward.tolist())
        terms.append(terminated.tolist())
        truncs.append(truncated.tolist())
    assert rewards == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.25, 0.0]]
    assert terms[-1] == [True, True, True, False]
    assert truncs == [[False] * 4, [False] * 4, [False, False, False, True]]
    # finished instances are no-ops; success is kept
    obs, reward, terminated, truncated, info = env.step([right[i] for i in range(4)])
    assert not reward.any() and terminated.tolist() == [True, True, True, False] and truncated[3]
    assert info["success"].tolist() == [True, True, True, False] and not info["action_is_valid"].any()
    assert obs[3] == "Incorrect. Please think again."


def test_default_budget_is_one_answer(data):
    env = fastpo.envs.make("metamathqa", 1, data_path=data)
    env.reset(np.array([3]))
    _, reward, terminated, truncated, _ = env.step(["wrong"])
    assert reward[0] == 0.0 and not terminated[0] and truncated[0]
    env.reset(np.array([3]))
    _, reward, terminated, truncated, _ = env.step([answer_of(3)])
    assert reward[0] == 1.0 and terminated[0] and not truncated[0]


def test_metamathqa_records_and_custom_keys(tmp_path):
    response = "Natalia sold 48 / 2 = 24 clips in May.\nThe answer is: 72"
    path = write_jsonl(tmp_path / "mm.jsonl", [{"query": "How many clips?", "response": response, "type": "GSM"}])
    for config in ({}, {"file_format": "metamathqa"}):
        env = fastpo.envs.make("metamathqa", 1, data_path=path, max_attempts=2, **config)
        assert env.reset(np.array([0])) == ["How many clips?"]
        assert env.answers() == ["72"]
        assert env.step(["48"])[1][0] == 0.0 and env.step(["72"])[1][0] == 0.5
    array = tmp_path / "mm.json"  # MetaMathQA-395K.json is a JSON array
    array.write_text(json.dumps([{"query": "q?", "response": "The answer is: \\frac{1}{2}"}], indent=1))
    env = fastpo.envs.make("qa", 1, data_path=str(array))
    env.reset(np.array([0]))
    assert env.step(["\\frac{1}{2}"])[1][0] == 1.0
    path = write_jsonl(tmp_path / "custom.jsonl", [{"q": "2+2?", "a": 4}])
    env = fastpo.envs.make("qa", 1, data_path=path, question_key="q", answer_key="a", instruction="Math.")
    assert env.reset(np.array([0])) == ["2+2?"] and env.instruction() == "Math."
    assert env.step(["4"])[1][0] == 1.0


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no records"),
        ("\n  \n", "no records"),
        ('{"question": "a", "answer": "b"}\n{"question": "c", "answer": \n', r"qa.jsonl:2: invalid JSON"),
        ('{"question": "a", "answer": "b"}\n\n["c", "d"]\n', r"qa.jsonl:3: expected a JSON object"),
        ('{"question": "a", "answer": "b"}\n{"question": "c"}\n', r"qa.jsonl:2: missing key"),
        ('{"question": "a", "answer": true}\n', r"qa.jsonl:1: 'answer' must be"),
        ('{"question": "", "answer": "b"}\n', r"qa.jsonl:1: 'question'"),
        ('{"question": "a", "answer": "  "}\n', r"qa.jsonl:1: the answer is empty"),
        ('{"prompt": "a", "label": "b"}\n', r"qa.jsonl:1: cannot tell the file format"),
        ('{"query": "a", "response": "b"}\n', r"qa.jsonl:1: 'response' has no 'The answer is"),
        ("[{", r"qa.jsonl:1: invalid JSON array"),
    ],
)
def test_bad_files_name_path_and_line(tmp_path, content, match):
    path = tmp_path / "qa.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        fastpo.envs.make("qa", 1, data_path=str(path))


def test_missing_file_and_bad_config(tmp_path, data):
    with pytest.raises(ValueError, match=r"nope\.jsonl.*does not exist"):
        fastpo.envs.make("qa", 1, data_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        fastpo.envs.make("qa", 1, data_path=str(tmp_path))  # a folder
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match="UTF-8"):
        fastpo.envs.make("qa", 1, data_path=str(tmp_path / "latin1.jsonl"))
    with pytest.raises(ValueError, match="needs data_path"):
        fastpo.envs.make("qa", 1)
    for config in ({"dataset_path": "x"}, {"file_format": "csv"}, {"max_attempts": 0}, {"max_attempts": 1.5}):
        with pytest.raises(ValueError):
            fastpo.envs.make("qa", 1, data_path=data, **config)


def test_bad_actions(data):
    env = fastpo.envs.make("qa", 2, data_path=data)
    env.reset(np.arange(2))
    for actions in (["42"], ("42", None), "42", [b"42", b"42"]):
        with pytest.raises(ValueError):
            env.step(actions)
