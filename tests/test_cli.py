"""fastpo.cli: flags and --config files read values with one converter (config_values.coerce), and every parse
failure is one ConfigError line, with tyro's parse-error hook or without it."""

import pytest

from fastpo.config import ConfigError
from fastpo.config_load import parse_args


@pytest.mark.parametrize("field,text", [
    ("optim.betas", "0.8,0.95"), ("optim.betas", "[0.5, 0.6]"), ("env.names", "sokoban,frozenlake"),
    ("trainer.log_wandb", "yes"), ("trainer.log_wandb", "off"), ("env.group_size", "4"), ("algorithm.clip_c", "inf"),
    ("env.kwargs", "{dim_room: [8, 8]}"), ("env.train", "[{name: sokoban, groups: 6}]"), ("rollout.stop", "[]"),
])
def test_a_flag_and_a_config_file_read_the_same_text_alike(tmp_path, field, text):
    section, name = field.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: '{text}'\n")  # the same text, as a YAML string
    from_flag = getattr(getattr(parse_args([f"--{field}", text]), section), name)
    from_file = getattr(getattr(parse_args(["--config", str(path)]), section), name)
    assert from_flag == from_file


@pytest.mark.parametrize("field,text,words", [
    ("optim.betas", "0.9", "expected 2 values"), ("env.group_size", "2.5", "expected int, got '2.5'"),
    ("trainer.log_wandb", "maybe", "expected a bool (true/false), got 'maybe'"),
    ("env.kwargs", "[1, 2]", "expected a YAML / JSON mapping"),
])
def test_a_flag_and_a_config_file_refuse_a_value_alike(tmp_path, field, text, words):
    section, name = field.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: '{text}'\n")
    for argv, start in (([f"--{field}", text], f"--{field}: "), (["--config", str(path)], f"{field}: ")):
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        assert str(err.value).startswith(start) and words in str(err.value) and "\n" not in str(err.value)


def test_without_the_parse_error_hook_a_failure_is_still_one_line(monkeypatch):
    """tyro's hook is private (tyro 1.0): where it is missing, tyro's own message comes back, its frame dropped."""
    import tyro

    monkeypatch.delattr(tyro, "_errors")
    for argv, words in ((["--algorithm.eps_hgh", "0.3"], "--algorithm.eps_hgh"),
                        (["--rollout.engine", "vlm"], "invalid choice 'vlm' for argument '--rollout.engine'"),
                        (["--env.group_size", "x"], "expected int, got 'x'")):
        with pytest.raises(ConfigError) as err:
            parse_args(argv)
        text = str(err.value)
        assert words in text and "\n" not in text and "╭" not in text and "----" not in text, text


@pytest.mark.parametrize("name,content,words", [
    ("missing.yaml", None, "cannot read {what}: No such file or directory"),
    ("folder", "dir", "cannot read {what}: Is a directory"),
    ("binary.yaml", b"\x00\xff\xfe", "{what} is not a text file ("),
    ("bad.yaml", b"a: [1\n", "{what} is not valid YAML: while parsing a flow sequence"),
])
def test_a_config_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, name, content, words):
    """--config and the RAGEN port read a file through one function (config_io.load_yaml_file): the same refusals."""
    from fastpo.ragen_config import PortError, load_ragen_yaml

    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    for read, err_type, what in ((lambda: parse_args(["--config", str(path)]), ConfigError, "--config file"),
                                 (lambda: load_ragen_yaml(path), PortError, "RAGEN config")):
        with pytest.raises(err_type) as err:
            read()
        text = str(err.value)
        assert words.format(what=f"{what} {str(path)!r}") in text and "\n" not in text, text


@pytest.mark.parametrize("argv", [["--trainer.keep_last", "3"], ["--trainer.keep_last=3"]])
@pytest.mark.parametrize("plain", [False, True], ids=["tyro", "plain"])
def test_a_renamed_flag_is_one_line_naming_the_new_flag(monkeypatch, plain, argv):
    """trainer.keep_last is now trainer.keep_checkpoints: a config file with the old name still loads (test_config),
    the old flag is refused with the new one named, by tyro's hook and by the plain parser alike."""
    from fastpo import cli

    if plain:
        monkeypatch.setattr(cli, "tyro", None)
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    text = str(err.value)
    assert text.startswith("Unrecognized options: --trainer.keep_last") and "\n" not in text, text
    assert text.endswith("; did you mean --trainer.keep_checkpoints? (the new name of trainer.keep_last)"), text
    assert parse_args(["--trainer.keep_checkpoints", "3"]).trainer.keep_checkpoints == 3
