"""fastpo.config_io: config text is read with bounded depth and size (YAML alias bombs, deep nesting) by every entry
point, and values echoed in error messages have a bounded length."""

from __future__ import annotations

import json
import time

import pytest

from fastpo import config, ragen_config, sft
from fastpo import eval as fastpo_eval
from fastpo.config import ConfigError, shown
from fastpo.config_io import MAX_DEPTH, MAX_NODES, load_json, load_yaml
from fastpo.config_load import from_json, parse_args
from fastpo.preflight import validate


def _bomb(levels: int = 7, indent: str = "    ") -> str:
    """A billion-laughs YAML body: 9 ** levels strings from ~50 bytes a line."""
    lines = [f'{indent}a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghijk"[: levels - 1]:
        lines.append(f"{indent}{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join(lines) + "\n"


BOMB_IN_KWARGS = "env:\n  kwargs:\n" + _bomb()  # env.kwargs takes any mapping: the bomb passes the type checks
DEEP = "[" * 10_000 + "]" * 10_000


def _one_line(message: str, *parts: str, limit: int = 600) -> None:
    assert "\n" not in message.strip() and len(message) < limit, message[:2000]
    for part in parts:
        assert part in message, message


def test_alias_bomb_and_deep_nesting_are_refused_by_the_loader():
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        load_yaml(_bomb(9, ""), "bomb.yaml")
    _one_line(str(err.value), "bomb.yaml expands to more than", str(MAX_NODES), "line")
    for text in (f"a: {DEEP}", "a:\n" + "".join(f"{'  ' * i}b{i}:\n" for i in range(1, 200)) + "  " * 200 + "x: 1"):
        with pytest.raises(ValueError) as err:
            load_yaml(text, "deep.yaml")
        _one_line(str(err.value), f"deep.yaml nests deeper than {MAX_DEPTH} levels")
    for text in ("a: &x [*x]", "a: &x {b: [1, *x]}"):
        with pytest.raises(ValueError, match="recursive alias"):
            load_yaml(text, "loop.yaml")
    with pytest.raises(ValueError) as err:
        load_json('{"a": ' + DEEP + "}", "deep.json")
    _one_line(str(err.value), "deep.json nests deeper than")
    assert time.perf_counter() - start < 5
    # what configs do is untouched: aliases, merge keys, JSON's non-finite floats
    assert load_yaml("a: &x [1, 2]\nb: *x\nc: {<<: {d: 1}, e: 2}\n", "ok") == {"a": [1, 2], "b": [1, 2],
                                                                            "c": {"d": 1, "e": 2}}
    with pytest.raises(ValueError, match="bin.yaml is not valid YAML: unacceptable character"):
        load_yaml("a:\x00\x07 b", "bin.yaml")
    assert load_json('{"x": Infinity}', "ok") == {"x": float("inf")}
    nested = {"s": {"f": [{"k": {"v": [1, 2]}}]}}
    assert load_yaml(json.dumps(nested), "ok") == nested == load_json(json.dumps(nested), "ok")


@pytest.mark.parametrize("where", ["config_file", "command_line"])
def test_train_refuses_a_bomb_or_deep_nesting_in_one_line(tmp_path, where):
    for name, text in (("bomb", BOMB_IN_KWARGS), ("deep", f"env:\n  kwargs: {{a: {DEEP}}}\n")):
        start = time.perf_counter()
        if where == "config_file":
            path = tmp_path / f"{name}.yaml"
            path.write_text(text)
            argv = ["--preset", "tiny", "--config", str(path)]
        else:  # the same mapping as a flag value
            argv = ["--preset", "tiny", "--env.kwargs", text.split("kwargs:", 1)[1].replace("\n    ", "\n")]
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        _one_line(str(err.value), "nests deeper than" if name == "deep" else "expands to more than")
        assert time.perf_counter() - start < 5


def test_eval_sft_and_ragen_config_refuse_deep_and_bombed_files(tmp_path, capsys):
    deep, bomb = tmp_path / "deep.yaml", tmp_path / "bomb.yaml"
    deep.write_text(f"env:\n  kwargs: {DEEP}\n")
    bomb.write_text(BOMB_IN_KWARGS)
    for main in (fastpo_eval.main, sft.main, ragen_config.main):
        for path, words in ((deep, "nests deeper than"), (bomb, "expands to more than")):
            start = time.perf_counter()
            argv = [str(path)] if main is ragen_config.main else ["--config", str(path)]
            assert main(argv) == 2
            err = capsys.readouterr().err
            _one_line(err, words, str(path))
            assert time.perf_counter() - start < 5
    # eval reads a run folder's config.json before parsing: a deep one is not taken for a run config
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"env": ' + DEEP + "}")
    assert fastpo_eval._run_config(["--model.path", str(run)]) is None
    with pytest.raises(ValueError, match="nests deeper than"):
        from_json('{"env": ' + DEEP + "}")


def test_ragen_interpolation_chains_cannot_blow_up(tmp_path):
    lines = ["a: [x, x, x, x, x, x, x, x, x]"] + [f"{c}: [" + ", ".join([f"'${{{p}}}'"] * 9) + "]"
                                                 for p, c in zip("abcdefghij", "bcdefghijk", strict=True)]
    path = tmp_path / "ragen.yaml"
    path.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    with pytest.raises(ragen_config.PortError, match="interpolations expand the config past"):
        ragen_config.load_ragen_yaml(path)
    assert time.perf_counter() - start < 5


def test_shown_bounds_any_value_and_keeps_short_ones_exact():
    assert shown("abc") == "'abc'" and shown([1, 2]) == "[1, 2]" and shown({"b": 1.5, "a": 1}) == "{'b': 1.5, 'a': 1}"
    x: list = [1]
    for _ in range(5000):  # 2 ** 5000 leaves once expanded
        x = [x, x]
    start = time.perf_counter()
    for value in ("z" * 10**6, x, 10**50_000, {str(i): i for i in range(10**5)}, b"\x00" * 10**6):
        text = shown(value)
        assert len(text) <= config.SHOWN_LIMIT + 10, text
    assert time.perf_counter() - start < 1


def test_error_messages_echo_a_bounded_value():
    for argv in (["--algorithm.eps_low", "9" * 20_000 + "x"], ["--model.dtype", "q" * 20_000],
                 ["--env.kwargs", "[" + ",".join(["1"] * 5_000) + "]"]):
        with pytest.raises(ConfigError) as err:
            parse_args(["--preset", "tiny", *argv])
        _one_line(str(err.value), argv[0].lstrip("-"), limit=1000)
    # kwargs an env refuses are echoed by the preflight check (once 800 MB for an alias bomb)
    many = "{bogus: [" + ",".join(["1"] * 5_000) + "]}"
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--preset", "tiny", "--env.kwargs", many]))
    _one_line(str(err.value).split("\n", 1)[1], "env.kwargs", "bogus", limit=1000)
