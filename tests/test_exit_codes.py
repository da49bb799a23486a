"""Exit codes of ``python -m fastpo.train`` and the one-line refusals of bad input (probe table).

2 = bad input, refused before any model loads; 1 = the run stopped itself; 0 = trained (the other trainer tests).
Most rows go through ``parse_args`` + ``validate`` in-process (fast); a few through the real entry point in a
subprocess, where the exit code and the absence of a traceback are the point.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastpo.config import INT64_MAX, ConfigError, all_fields
from fastpo.config_load import parse_args
from fastpo.preflight import validate

TINY = ["--preset", "tiny"]

# (CLI args, words the error must hold); {tmp} is replaced by a per-test folder holding "afile" (a plain file)
PROBES = [
    ([*TINY, "--env.kwargs", '{"foo": 1}'], ["env.kwargs", "'foo'", "accepted:", "is_slippery"]),
    ([*TINY, "--env.kwargs", '{"size": "big"}'], ["env.kwargs", "'frozenlake'", "size"]),
    (["--preset", "sokoban", "--env.kwargs", '{"dim_room": [4, 4]}'],
     ["env.kwargs", "dim_room", "could not generate a Sokoban level", "(4, 4)"]),
    (["--preset", "sokoban", "--env.kwargs", '{"num_boxes": 8}'], ["env.kwargs", "num_boxes=8", "could not generate"]),
    (["--preset", "countdown", "--env.kwargs", '{"data_path": "{tmp}/nope.jsonl"}'], ["env.kwargs", "nope.jsonl"]),
    ([*TINY, "--model.path", "{tmp}/afile"], ["model.path", "afile", "is a file, not a directory"]),
    ([*TINY, "--model.path", "{tmp}/missing_model"], ["model.path", "missing_model", "does not exist"]),
    ([*TINY, "--model.path", "{tmp}"], ["model.path", "has none of ['config.json']"]),
    ([*TINY, "--trainer.resume", "{tmp}/no_ckpt"], ["trainer.resume", "no_ckpt", "'auto', 'never'"]),
    ([*TINY, "--trainer.resume", "{tmp}/emptydir"], ["trainer.resume", "emptydir", "is not a checkpoint folder",
                                                      "checkpoints/step-NNNNNN", "COMPLETE"]),
    ([*TINY, "--trainer.resume", "{tmp}/old"], ["trainer.resume", "is a run folder", "old/checkpoints/step-000002",
                                                "--trainer.resume auto"]),
    ([*TINY, "--trainer.resume", "{tmp}/old/checkpoints"], ["trainer.resume", "old/checkpoints/step-000002"]),
    ([*TINY, "--trainer.resume", "{tmp}/old/checkpoints/step-000003"], ["trainer.resume", "step-000003",
                                                                        "no COMPLETE", "interrupted"]),
    ([*TINY, "--trainer.run_dir", "{tmp}/afile"], ["trainer.run_dir", "afile", "is a file"]),
    ([*TINY, "--trainer.run_dir", "{tmp}/afile/run"], ["trainer.run_dir", "lies under the file"]),
    ([*TINY, "--rollout.temperature", "inf"], ["rollout.temperature", "finite", "inf"]),
    ([*TINY, "--rollout.temperature", "nan"], ["rollout.temperature", "finite", "nan"]),
    ([*TINY, "--algorithm.gamma", "nan"], ["algorithm.gamma", "finite", "nan"]),
    ([*TINY, "--optim.betas", "[0.9, nan]"], ["optim.betas", "finite"]),
    ([*TINY, "--env.train_seed", str(INT64_MAX - 5)], ["env.train_seed", "int64", "must be <="]),
    ([*TINY, "--env.val_seed", str(INT64_MAX)], ["env.val_seed", "int64"]),
    ([*TINY, "--trainer.iterations", str(INT64_MAX // 2)], ["trainer.iterations (4611686018427387903) must be <=",
                                                            "env.env_groups", "int64"]),
    ([*TINY, "--trainer.seed", str(INT64_MAX + 1)], ["trainer.seed", "must be <="]),
    ([*TINY, "--rollout.engine", "vllm", "--trainer.seed", str(2**32)], ["trainer.seed", "4294967295", "vLLM"]),
    (["--config", "{tmp}/binary.yaml"], ["--config", "binary.yaml", "not a text file"]),
    (["--config", "{tmp}/list.yaml"], ["list.yaml", "expected a mapping of sections", "got list"]),
    (["--config", "{tmp}/control.yaml"], ["--config", "control.yaml", "not valid YAML"]),
]


@pytest.fixture
def probe_dir(tmp_path):
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    (tmp_path / "control.yaml").write_bytes(b"model:\x00\x07 path: x\n")
    (tmp_path / "emptydir").mkdir()
    step = tmp_path / "old" / "checkpoints" / "step-000002"  # a run folder with one complete checkpoint
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    (step / "trainer_state.json").write_text('{"step": 2, "trainer_state": {}}')
    (step.parent / "step-000003").mkdir()  # one cut short (no marker)
    return tmp_path


def _args(args, tmp) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in args]


def _refusal(args: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(parse_args(args), 1)
    return str(info.value)


@pytest.mark.parametrize("args,words", PROBES, ids=[" ".join(p[0][2:] or p[0])[:50] for p in PROBES])
def test_bad_input_is_refused_in_one_line_naming_the_field(args, words, probe_dir, monkeypatch):
    monkeypatch.chdir(probe_dir)
    message = _refusal(_args(args, probe_dir))
    problems = [line for line in message.splitlines() if line.strip() and line != "invalid config:"]
    assert len(problems) == 1, message
    for word in words:
        assert word.replace("{tmp}", str(probe_dir)) in message, (word, message)


def test_limits_are_the_real_ones(probe_dir, monkeypatch):
    """The largest accepted seeds run; one more is refused."""
    monkeypatch.chdir(probe_dir)
    cfg = parse_args([*TINY])
    last = INT64_MAX - (cfg.trainer.iterations + 1) * cfg.env.env_groups + 1  # the last group's seed is INT64_MAX
    validate(parse_args([*TINY, "--env.train_seed", str(last)]), 1)
    assert "env.train_seed" in _refusal([*TINY, "--env.train_seed", str(last + 1)])
    validate(parse_args([*TINY, "--env.val_seed", str(INT64_MAX - cfg.env.val_groups + 1)]), 1)
    # a huge trainer.iterations is named as the cause (it was blamed on env.train_seed, with a negative bound)
    most = (INT64_MAX - cfg.env.train_seed + 1) // cfg.env.env_groups - 1
    validate(parse_args([*TINY, "--trainer.iterations", str(most)]), 1)
    message = _refusal([*TINY, "--trainer.iterations", str(most + 1)])
    assert message.split("\n")[1].strip().startswith(f"trainer.iterations ({most + 1}) must be <= {most}"), message
    validate(parse_args([*TINY, "--rollout.engine", "vllm", "--trainer.seed", str(2**32 - 2)]), 2)
    with pytest.raises(ConfigError, match="trainer.seed must be <= 4294967294"):
        validate(parse_args([*TINY, "--rollout.engine", "vllm", "--trainer.seed", str(2**32 - 1)]), 2)
    # the env seeds really reach int64 code at the limit: the env resets there
    import numpy as np

    from fastpo import envs

    envs.make("sokoban", 1).reset(np.array([INT64_MAX]))
    for inf_ok in ("--algorithm.clip_c", "--trainer.logprob_gap_max"):  # documented "inf disables"
        validate(parse_args([*TINY, inf_ok, "inf"]), 1)


def test_read_only_checkpoints_folder_is_refused_at_start_up(probe_dir, monkeypatch):
    """A run folder whose checkpoints/ cannot be written passed the run-dir check and failed at the first save,
    after a full iteration."""
    monkeypatch.chdir(probe_dir)
    run = probe_dir / "ro_run"
    (run / "checkpoints").mkdir(parents=True)
    validate(parse_args([*TINY, "--trainer.run_dir", str(run)]), 1)
    (run / "checkpoints").chmod(0o555)
    if os.geteuid() == 0:  # root writes through the mode bits: let access() answer as for a read-only mount
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p).name != "checkpoints" and real(p, mode, **kw))
    try:
        message = _refusal([*TINY, "--trainer.run_dir", str(run)])
    finally:
        (run / "checkpoints").chmod(0o755)
    assert "trainer.run_dir" in message and f"{run / 'checkpoints'}' is not writable" in message, message
    assert len(message.splitlines()) == 2, message


def test_config_hash_mismatch_is_refused_up_front_with_real_options(probe_dir, monkeypatch):
    import torch

    from fastpo import checkpoint

    monkeypatch.chdir(probe_dir)
    run = probe_dir / "run"
    checkpoint.save(run, 1, {"m": torch.nn.Linear(2, 2)}, {"x": 1}, config_hash="0123456789abcdef")
    message = _refusal([*TINY, "--trainer.run_dir", str(run)])
    assert "config hash 0123456789abcdef" in message and "trainer.resume" in message
    options = set(re.findall(r"--[a-z_]+(?:\.[a-z_]+)?", message))
    assert options and options <= {f"--{f}" for f in all_fields()} | {"--config", "--preset"}, options
    validate(parse_args([*TINY, "--trainer.run_dir", str(run), "--trainer.resume", "never"]), 1)
    with pytest.raises(ValueError) as info:  # the loader's own message offers the same real options
        checkpoint.resume(run, {"m": torch.nn.Linear(2, 2)}, config_hash="fedcba9876543210")
    assert set(re.findall(r"--[a-z_]+(?:\.[a-z_]+)?", str(info.value))) <= options | {"--config"}


def _train(args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                **(env or {})}
    # cwd is not the repo root (there ./kernels would shadow the HF kernels probe; see test_trainer)
    return subprocess.run([sys.executable, "-m", "fastpo.train", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_entry_point_exit_2_without_traceback(probe_dir, capsys, monkeypatch):
    """Through the real entry point: one error line, exit 2, nothing written, for a refusal of the config (a
    binary --config), of the world (a model path that is a file) and of the tokenizer (a prompt that cannot fit).
    The first in a new interpreter; the others through fastpo.train's main in this process (the same code path up
    to the exit: an exception that escaped main would fail the test as a traceback fails the subprocess)."""
    from fastpo.train import main

    res = _train(["--config", "binary.yaml"], probe_dir)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "not a text file" in res.stderr, res.stderr[-3000:]
    assert res.stderr.startswith("config error:")
    monkeypatch.chdir(probe_dir)  # the relative run dirs below, as for the subprocess
    for args, words in (
        ([*TINY, "--model.path", str(probe_dir / "afile"), "--trainer.run_dir", "r1"], "is a file, not a directory"),
        ([*TINY, "--rollout.max_model_len", "60", "--rollout.response_length", "20", "--trainer.run_dir", "r2"],
         "rollout.max_model_len (60) is too short"),
    ):
        capsys.readouterr()
        status = main(args)
        err = capsys.readouterr().err
        assert status == 2, err[-3000:]
        assert words in err and err.startswith("config error:"), err[-3000:]
    assert not (probe_dir / "r1").exists()
    assert not list((probe_dir / "r2").glob("checkpoints/*")) and not (probe_dir / "r2" / "hf").exists()


def test_help_and_config_errors_answer_before_the_trainer_is_imported(probe_dir):
    """`--help` imports no torch, and a config refused by the checks imports neither transformers nor the trainer;
    as torchrun starts ranks, only a node's first rank (LOCAL_RANK 0) prints the error."""
    code = ("import sys; from fastpo.train import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('LOADED', rc, *(m for m in ('torch', 'transformers', 'fastpo.trainer') if m in sys.modules))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(args: list[str], **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=probe_dir, env={**env, **extra},
                              capture_output=True, text=True, timeout=120)

    res = run(["--help"])
    assert res.stdout.splitlines()[-1] == "LOADED 0", res.stdout[-500:] + res.stderr[-2000:]
    bad = [*TINY, "--rollout.max_staleness", "-3", "--trainer.run_dir", "r"]
    res = run(bad)
    assert res.stdout.splitlines()[-1] == "LOADED 2 torch", res.stdout[-500:] + res.stderr[-2000:]
    assert res.stderr.startswith("config error:") and "rollout.max_staleness must lie in [1, 8], got -3" in res.stderr
    res = run(bad, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    assert res.stdout.splitlines()[-1] == "LOADED 2 torch" and res.stderr == "", res.stderr[-2000:]
    res = run(bad, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2")  # the first rank of a second node speaks there
    assert res.stderr.startswith("config error:"), res.stderr[-2000:]
    assert not (probe_dir / "r").exists()


def test_help_documents_the_exit_codes(capsys):
    import fastpo.train

    with pytest.raises(SystemExit) as info:
        fastpo.train.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "Exit status: 0 = trained, 1 = the run stopped itself" in out
    assert "2 = bad input" in out
    assert "1  the run stopped itself" in fastpo.train.__doc__ and "2  bad input" in fastpo.train.__doc__


def test_an_iteration_without_a_trained_token_stops_with_exit_1(probe_dir, monkeypatch, capsys):
    """The run-time backstop of the prompt check: with that check bypassed, a context cap below the prompt gives
    0-turn episodes, and the first iteration stops the run (exit 1, no export) instead of training on nothing."""
    import fastpo.startup
    from fastpo.train import main

    monkeypatch.chdir(probe_dir)
    monkeypatch.setattr(fastpo.startup, "check_prompt_fits", lambda cfg, tok: None)
    run = probe_dir / "run"
    rc = main([*TINY, "--env.env_groups", "2", "--env.group_size", "2", "--optim.mini_batch_size", "2",
               "--env.val_groups", "2", "--rollout.max_model_len", "60", "--rollout.response_length", "20",
               "--optim.micro_batch_tokens", "60", "--trainer.val_before_train", "false", "--trainer.iterations", "2",
               "--trainer.run_dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    assert "training stopped: iteration 1: no trajectory has a trained token" in err and "mean turns per episode 0" \
        in err
    assert not (run / "hf").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] if (
        run / "metrics.jsonl").exists() else []
    assert not any(row.get("step", 0) >= 1 and "actor/pg_loss" in row for row in rows)
