"""fastpo.model_path: one resolver of model.path for train, eval, sft and report; each refusal is one line naming the
path and what to pass (the test session runs with HF_HUB_OFFLINE=1: no hub is reachable)."""

import json

import pytest

from fastpo.model_path import resolve_model_path
from fastpo.tiny_agent import tiny_agent_path


def _one_line(fn, *pieces):
    with pytest.raises(ValueError) as err:
        fn()
    text = str(err.value)
    assert "\n" not in text, text
    for piece in pieces:
        assert piece in text, (piece, text)


def _model_folder(path, tokenizer=True):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    if tokenizer:
        (path / "tokenizer_config.json").write_text("{}")
    return path


def test_every_kind_of_model_path(tmp_path):
    assert resolve_model_path("tiny") == str(tiny_agent_path())
    model = _model_folder(tmp_path / "model")
    assert resolve_model_path(model) == str(model) == resolve_model_path(model, "tokenizer")
    run = tmp_path / "run"
    _model_folder(run / "hf")
    (run / "config.json").write_text(json.dumps({"env": {}, "rollout": {}, "trainer": {}}))
    _one_line(lambda: resolve_model_path(run), f"{str(run / 'hf')!r} has no COMPLETE marker", "interrupted export")
    _one_line(lambda: resolve_model_path(run / "hf"), "has no COMPLETE marker")  # <run>/hf named directly
    (run / "hf" / "COMPLETE").write_text("{}")
    assert resolve_model_path(run) == str(run / "hf") == resolve_model_path(run / "hf")
    step = run / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    (step / ".metadata").write_bytes(b"")
    _one_line(lambda: resolve_model_path(step), repr(str(step)), "is a training checkpoint", "pass the run folder",
              "--trainer.resume")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_text(json.dumps({"env": {}, "rollout": {}, "trainer": {}}))
    _one_line(lambda: resolve_model_path(unfinished), repr(str(unfinished)), "run folder without an hf/ export")


def test_bad_paths_and_hub_ids_are_one_line(tmp_path):
    _one_line(lambda: resolve_model_path(tmp_path / "nope"), repr(str(tmp_path / "nope")), "does not exist",
              "save_pretrained")
    (tmp_path / "afile").write_text("x")
    _one_line(lambda: resolve_model_path(tmp_path / "afile"), "is a file, not a directory")
    _one_line(lambda: resolve_model_path(tmp_path), "model directory", "has none of ['config.json']")
    no_tokenizer = _model_folder(tmp_path / "no_tok", tokenizer=False)
    _one_line(lambda: resolve_model_path(no_tokenizer, "tokenizer"), "tokenizer directory", "tokenizer.json")
    _one_line(lambda: resolve_model_path("fastpo-test/not-a-model"), "'fastpo-test/not-a-model'",
              "not in the Hugging Face cache while HF_HUB_OFFLINE=1")
    _one_line(lambda: resolve_model_path(""), "a directory path or a hub id")


@pytest.mark.slow
def test_eval_model_path_tiny_loads_the_tiny_agent():
    """``python -m fastpo.eval --model.path tiny`` evaluates the shipped tiny agent; "tiny" is never a hub id."""
    from fastpo.eval import parse_args, prepare

    args = parse_args(["--model.path", "tiny", "--env.names", "frozenlake", "--env.val_groups", "2",
                       "--eval.device", "cpu"])
    _, tokenizer, model, path = prepare(args)
    assert path == str(tiny_agent_path())
    assert model.config.vocab_size >= len(tokenizer) and model.training is False


def test_train_with_an_unavailable_hub_id_is_one_config_error_line(tmp_path, capsys):
    """A hub id that is neither a folder nor cached (offline) stops training before any model loads: exit 2 and one
    ``config error:`` line naming model.path and the id (it was a ValueError traceback from the tokenizer load)."""
    from fastpo.train import main

    status = main(["--preset", "tiny", "--model.path", "fastpo-test/not-a-model", "--trainer.run_dir",
                   str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: model.path: "), err
    assert "'fastpo-test/not-a-model'" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
