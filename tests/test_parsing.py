"""fastpo.parsing against RAGEN's rules (ragen/llm_agent/ctx_manager.py ``_parse_response``,
es_manager.py ``step`` / ``_extract_map_valid_actions``), transcribed below as the oracle ``ragen_turn``."""

import random
import re
import time

import pytest

from fastpo.parsing import (
    ParsedResponse,
    _search_answer,
    _search_think_answer,
    canonical_response,
    generation_prefix,
    parse_actions,
    parse_generation,
    parse_response,
    parse_turn,
    turn_format_penalty,
    within_budget,
)

SOKOBAN = ["Up", "Down", "Left", "Right"]
THINK_RE = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>"
ANSWER_RE = r"<answer>(.*?)</answer>"
SPECIAL = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]


def ragen_turn(response, enable_think, action_lookup, sep="||", max_actions=5):
    """RAGEN's code path, written out: -> (llm_response, actions, mapped_actions, penalised)."""
    match = re.search(THINK_RE if enable_think else ANSWER_RE, response, re.DOTALL)
    if not match:
        llm_response, actions = response, []
    else:
        if enable_think:
            think_content, action_content = match.group(1), match.group(2)
        else:
            think_content, action_content = "", match.group(1)
        for special_token in SPECIAL:
            action_content = action_content.replace(special_token, "").strip()
            think_content = think_content.replace(special_token, "").strip()
        actions = [a.strip() for a in action_content.split(sep) if a.strip()]
        if len(actions) > max_actions:
            actions = actions[:max_actions]
            action_content = (" " + sep + " ").join(actions)
        llm_response = (
            f"<think>{think_content}</think><answer>{action_content}</answer>"
            if enable_think
            else f"<answer>{action_content}</answer>"
        )
    if action_lookup is None:
        mapped = actions
    else:
        rev = {v.lower(): k for k, v in action_lookup.items()}
        mapped = [rev[a.lower()] for a in actions if a.lower() in rev]
    return llm_response, actions, mapped, (len(mapped) != len(actions) or not mapped)


def ours(response, enable_think, names, sep="||", max_actions=5):
    resp = parse_response(response, enable_think)
    acts = parse_actions(resp.answer, names, sep, max_actions)
    mapped = acts.ids if names else acts.names
    return canonical_response(resp, acts, enable_think), acts.kept, mapped, turn_format_penalty(acts) != 0.0


# ---------------------------------------------------------------- the pattern


def test_basic_think_answer():
    r = parse_response("<think> go down </think>\n<answer> Down || Left </answer>")
    assert r == ParsedResponse(think="go down", answer="Down || Left", format_ok=True, raw=r.raw)


def test_parse_generation_prepends_prefix():
    assert generation_prefix(True) == "<think>" and generation_prefix(False) == "<answer>"
    r = parse_generation("I push.</think><answer>Up</answer>")
    assert r.think == "I push." and r.answer == "Up" and r.raw.startswith("<think>I push.")
    r = parse_generation("Up || Down</answer>", enable_think=False)
    assert r.think == "" and r.answer == "Up || Down" and r.raw == "<answer>Up || Down</answer>"


def test_think_disabled_ignores_think_tags():
    r = parse_response("<think>hmm</think><answer>Left</answer>", enable_think=False)
    assert (r.think, r.answer, r.format_ok) == ("", "Left", True)
    # Without </think> the think pattern fails but the answer pattern does not.
    assert not parse_response("<answer>Left</answer>", enable_think=True).format_ok
    assert parse_response("<answer>Left</answer>", enable_think=False).answer == "Left"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Down",
        "<think>x</think><answer>Up",  # missing </answer>
        "<think>x<answer>Up</answer>",  # missing </think>
        "<think>x</think>Up</answer>",  # missing <answer>
        "x</think><answer>Up</answer>",  # missing <think>
        "<think>x</think> so <answer>Up</answer>",  # text between the blocks
        "<think>x</think>\u200b<answer>Up</answer>",  # zero-width space is not whitespace
        "<THINK>x</THINK><ANSWER>Up</ANSWER>",  # tags are case-sensitive
        "<answer>Up</answer><think>x</think>",  # wrong order
        "<think>x</think><answer>Up</answer",
    ],
)
def test_malformed_does_not_match(text):
    r = parse_response(text)
    assert (r.think, r.answer, r.format_ok, r.raw) == (None, None, False, text)
    assert re.search(THINK_RE, text, re.DOTALL) is None


@pytest.mark.parametrize("ws", ["", " ", "\n", "\n\n \t", "\r\n", "\u3000", "\xa0", "\u2028", "\x1c"])
def test_whitespace_between_blocks(ws):
    r = parse_response(f"<think>a</think>{ws}<answer>Up</answer>")
    assert (r.think, r.answer) == ("a", "Up")


@pytest.mark.parametrize(
    "text, think, answer",
    [
        # Repeated blocks: the first complete one wins.
        ("<think>a</think><answer>Up</answer><think>b</think><answer>Down</answer>", "a", "Up"),
        # Nested opening tag: the match starts at the first <think>; inner tags are deleted.
        ("<think><think>x</think><answer>Up</answer>", "x", "Up"),
        # A </think> not followed by <answer> stays inside the think group.
        ("<think>a</think> junk <think>b</think>\n<answer>Left</answer>", "a junk b", "Left"),
        # The answer group ends at the first </answer>.
        ("<think>t</think><answer><answer>Up</answer></answer>", "t", "Up"),
        ("<think>t</think><answer>Up</answer>Down</answer>", "t", "Up"),
        # RAGEN's own example from ctx_manager.main.
        ("<think><think></answer> 123. </think><answer> <answer> say | hi </answer></answer>", "123.", "say | hi"),
        # Sequential deletion: removing <think> exposes a </think> that is removed next.
        ("<think>a </<think>think> b</think><answer>x<|im_end|></answer>", "a  b", "x"),
        # Chat special strings are deleted too.
        ("<think><|im_start|>hi<|im_end|></think><answer><|im_end|>Up</answer>", "hi", "Up"),
        # Empty groups.
        ("<think></think><answer></answer>", "", ""),
        # Newlines inside groups (DOTALL).
        ("<think>line1\nline2</think><answer>\nUp\n||\nDown\n</answer>", "line1\nline2", "Up\n||\nDown"),
    ],
)
def test_nested_and_repeated_tags(text, think, answer):
    r = parse_response(text)
    assert (r.think, r.answer, r.format_ok) == (think, answer, True)
    assert canonical_response(r, parse_actions(r.answer, SOKOBAN)) == ragen_turn(text, True, None)[0]


def test_no_think_first_answer_block():
    r = parse_response("<answer>Up</answer><answer>Down</answer>", enable_think=False)
    assert r.answer == "Up"
    assert not parse_response("<answer>Up", enable_think=False).format_ok
    assert parse_response("<answer><answer>Up</answer>", enable_think=False).answer == "Up"


def test_rejects_non_str():
    with pytest.raises(TypeError, match="str"):
        parse_response(None)


# ---------------------------------------------------------------- equivalence with re.search

_ALPHABET = [
    "<think>", "</think>", "<answer>", "</answer>", "<|im_end|>", "<|im_start|>", "<think", "</", "<", ">",
    "think>", "answer>", "/", " ", "\n", "\t", "\u3000", "\u200b", "||", "|", "Up", "down", "LEFT", "foo", "x",
]  # fmt: skip


_WS = ["", " ", "\n", "\t", "\u3000", "\u200b"]
_SKELETON = ["<think>", None, "</think>", "ws", "<answer>", None, "</answer>", None]


def _random_text(rng, max_len=24):
    """Half pure noise, half think/answer skeletons (repeated, with tags randomly dropped) filled with noise,
    so that both matches and near-misses are common."""

    def noise(n):
        return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(n)))

    if rng.random() < 0.5:
        return noise(max_len)
    parts = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        for tok in _SKELETON:
            if tok is None:
                parts.append(noise(max_len // 4))
            elif tok == "ws":
                parts.append(rng.choice(_WS))
            elif rng.random() > 0.1:
                parts.append(tok)
    return "".join(parts)


def test_linear_search_equals_regex_fuzz():
    rng = random.Random(0)
    for _ in range(4000):
        text = _random_text(rng)
        m = re.search(THINK_RE, text, re.DOTALL)
        assert _search_think_answer(text) == (None if m is None else m.span(1) + m.span(2)), text
        m = re.search(ANSWER_RE, text, re.DOTALL)
        assert _search_answer(text) == (None if m is None else m.span(1)), text


def test_whole_turn_equals_ragen_fuzz():
    rng = random.Random(1)
    lookup = {i + 1: n for i, n in enumerate(SOKOBAN)}
    for _ in range(3000):
        text = _random_text(rng, 30)
        think = rng.random() < 0.7
        max_actions = rng.choice([1, 2, 5])
        sep = rng.choice(["||", "|"])
        assert ours(text, think, SOKOBAN, sep, max_actions) == ragen_turn(text, think, lookup, sep, max_actions), text
        assert ours(text, think, None, sep, max_actions) == ragen_turn(text, think, None, sep, max_actions), text


def test_fuzz_covers_matches():
    # Guard against a fuzz alphabet that never produces a match (the equivalence tests would be vacuous).
    rng = random.Random(0)
    hits = sum(parse_response(_random_text(rng)).format_ok for _ in range(3000))
    assert 600 < hits < 2400


# ---------------------------------------------------------------- long and adversarial inputs

ADVERSARIAL = [
    lambda n: "<think>" * n,
    lambda n: "<think></think>" * n,
    lambda n: "<think>" + "</think><answer>" * n,
    lambda n: "<think>" + "</think>" * n + "</answer>",
    lambda n: "<think>" * n + "</think>" + " " * n + "<answer>",
    lambda n: "<think>" + ("</think>" + " " * 5) * n + "</answer>",
    lambda n: "<answer>" * n,
    lambda n: "<think>x</think>" + "<answer>" * n + "</answer>",
]


@pytest.mark.parametrize("make", ADVERSARIAL)
def test_adversarial_is_linear_and_equals_regex(make):
    small = make(300)
    for think in (True, False):
        m = re.search(THINK_RE if think else ANSWER_RE, small, re.DOTALL)
        spans = _search_think_answer(small) if think else _search_answer(small)
        expected = None if m is None else (m.span(1) + m.span(2) if think else m.span(1))
        assert spans == expected
    big = make(50_000)
    start = time.perf_counter()
    parse_response(big, True)
    parse_response(big, False)
    # re.search needs minutes here (quadratic); a linear scan of ~1 MB takes milliseconds.
    assert time.perf_counter() - start < 1.0


def test_long_output_100k_chars():
    think = "I consider moving. " * 5300  # ~100k chars
    text = f"<think>{think}</think>\n<answer>Right || Up</answer>"
    assert len(text) > 100_000
    start = time.perf_counter()
    r = parse_response(text)
    a = parse_actions(r.answer, SOKOBAN)
    assert time.perf_counter() - start < 0.5
    assert r.think == think.strip() and a.names == ["Right", "Up"]
    # A long answer with many separators is linear too.
    a = parse_actions(" || ".join(["Up"] * 30_000), SOKOBAN)
    assert a.num_raw == 30_000 and a.ids == [1] * 5 and a.truncated


# ---------------------------------------------------------------- actions


@pytest.mark.parametrize(
    "answer, names",
    [
        ("Up||Down", ["Up", "Down"]),
        (" || Up || || Down ||", ["Up", "Down"]),  # leading, trailing, double separators
        ("Up |||| Down", ["Up", "Down"]),
        ("||||", []),
        ("   ", []),
        ("uP || DOWN || left || RiGhT", ["Up", "Down", "Left", "Right"]),
        ("Up\n||\nDown", ["Up", "Down"]),
        ("\u3000Up\u3000||\xa0Left\xa0", ["Up", "Left"]),  # str.strip removes Unicode whitespace
    ],
)
def test_split_strip_case(answer, names):
    a = parse_actions(answer, SOKOBAN)
    assert a.names == names and a.ids == [SOKOBAN.index(n) + 1 for n in names]
    assert a.all_valid


@pytest.mark.parametrize(
    "piece",
    [
        "Ｕｐ",  # fullwidth: str.lower() does not fold it to "up"
        "⬆️",
        "يمين",  # RTL
        "\u202eUp",  # RTL override mark is not whitespace
        "Up.",
        "move Up",
        "U p",
        "Up | Down",  # single bar is not the separator
        "1",
    ],
)
def test_invalid_names_are_dropped(piece):
    a = parse_actions(f"Left || {piece}", SOKOBAN)
    assert a.names == ["Left"] and a.ids == [3] and not a.all_valid and a.kept == ["Left", piece]
    assert turn_format_penalty(a) == pytest.approx(-0.1)


def test_lower_not_casefold():
    a = parse_actions("GRÖSSE || größe", ["Größe"])
    assert a.names == ["Größe"] and a.kept == ["GRÖSSE", "größe"]  # "GRÖSSE".lower() == "grösse"
    assert parse_actions("ΣΟΦΙΑ", ["σοφια"]).names == ["σοφια"]


def test_triple_bar_leaves_a_bar():
    a = parse_actions("Up ||| Down", SOKOBAN)
    assert a.kept == ["Up", "| Down"] and a.names == ["Up"] and not a.all_valid


def test_truncation_before_validity():
    a = parse_actions(" || ".join(["Up"] * 5 + ["foo"]), SOKOBAN)
    assert a.kept == ["Up"] * 5 and a.all_valid and a.truncated and a.num_raw == 6
    assert not a.raw_all_valid
    assert turn_format_penalty(a) == 0.0
    assert turn_format_penalty(a, count_truncated=True) == pytest.approx(-0.1)
    a = parse_actions(" || ".join(["foo"] + ["Up"] * 5), SOKOBAN)
    assert a.kept == ["foo"] + ["Up"] * 4 and a.ids == [1] * 4
    assert turn_format_penalty(a) == pytest.approx(-0.1)


def test_more_than_max_rewrites_answer():
    answer = "up||down||left||right||up||down||left"
    a = parse_actions(answer, SOKOBAN, max_actions=5)
    assert a.answer_text == "up || down || left || right || up"  # kept spelling, RAGEN's " || " join
    assert a.ids == [1, 2, 3, 4, 1] and a.num_raw == 7
    r = parse_response(f"<think>t</think><answer>{answer}</answer>")
    assert canonical_response(r, a) == "<think>t</think><answer>up || down || left || right || up</answer>"
    a = parse_actions("up||down", SOKOBAN)
    assert a.answer_text == "up||down" and not a.truncated  # not rewritten when within the cap


def test_only_invalid_and_empty():
    for answer in ("foo || bar", "", None):
        a = parse_actions(answer, SOKOBAN)
        assert a.names == [] and a.ids == []
        assert turn_format_penalty(a) == pytest.approx(-0.1)
        assert turn_format_penalty(a, format_penalty=-0.5) == pytest.approx(-0.5)
    assert turn_format_penalty(parse_actions("Up", SOKOBAN)) == 0.0


def test_text_env_answers():
    a = parse_actions("2 + 5 - 3", None, max_actions=1)
    assert a.names == ["2 + 5 - 3"] and a.ids == [] and a.all_valid
    assert turn_format_penalty(a) == 0.0
    a = parse_actions(" (44 - 19) * 35 || 12 ", [], max_actions=1)  # RAGEN splits text answers too
    assert a.names == ["(44 - 19) * 35"] and a.truncated and a.answer_text == "(44 - 19) * 35"
    assert turn_format_penalty(parse_actions("  ", None, max_actions=1)) == pytest.approx(-0.1)
    assert parse_actions("Dragon", ["Phoenix", "Dragon"], max_actions=1).ids == [2]  # Bandit arms


def test_duplicate_names_last_wins():
    assert parse_actions("a", ["A", "a"]).ids == [2]


@pytest.mark.parametrize(
    "kwargs", [{"action_sep": ""}, {"action_sep": None}, {"max_actions": 0}, {"max_actions": True}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        parse_actions("Up", SOKOBAN, **kwargs)


# ---------------------------------------------------------------- budget, canonical, parse_turn


def test_within_budget():
    assert within_budget([1, 2, 3], 2) == [1, 2]
    assert within_budget([1, 2, 3], 10) == [1, 2, 3]
    assert within_budget([1, 2, 3], 0) == [] and within_budget([1], -3) == []
    assert within_budget(["x"], 1) == ["x"]


def test_canonical_response():
    r = parse_response("<think>  plan </think>  <answer> Up ||Down </answer>")
    a = parse_actions(r.answer, SOKOBAN)
    assert canonical_response(r, a) == "<think>plan</think><answer>Up ||Down</answer>"
    r = parse_response("<answer> Left </answer>", enable_think=False)
    assert canonical_response(r, parse_actions(r.answer, SOKOBAN), False) == "<answer>Left</answer>"
    r = parse_generation("I am not sure. Up")
    assert canonical_response(r, parse_actions(r.answer, SOKOBAN)) == "<think>I am not sure. Up"


def test_parse_turn():
    t = parse_turn("go.</think><answer>Up || foo || Left || Down</answer>", SOKOBAN, actions_left=2)
    assert t.to_execute == [1, 3] and t.actions.ids == [1, 3, 2]
    assert t.penalty == pytest.approx(-0.1)
    assert t.canonical == "<think>go.</think><answer>Up || foo || Left || Down</answer>"
    t = parse_turn("Phoenix </answer>", ["Dragon", "Phoenix"], 1, enable_think=False, max_actions=1)
    assert t.to_execute == [2] and t.penalty == 0.0 and t.canonical == "<answer>Phoenix</answer>"
    t = parse_turn("x</think><answer>1 + 2</answer>", None, 1, max_actions=1)
    assert t.to_execute == ["1 + 2"] and t.penalty == 0.0
    t = parse_turn("no tags at all", SOKOBAN, 5)
    assert t.to_execute == [] and t.penalty == pytest.approx(-0.1) and not t.response.format_ok
