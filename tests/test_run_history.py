"""Run history vs checkpoints: metrics.jsonl holds every step once across kills and resumes, resume=never never
silently replaces a previous run, trainer.overwrite starts a fresh one, step 0's row holds step 0's timings."""

import json
import subprocess
from pathlib import Path

import pytest

from fastpo.config import ConfigError
from fastpo.metrics import MetricsLogger
from fastpo.storage import claim_run_dir

SMALL = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.val_groups", "4",
         "--env.env_groups", "4", "--env.group_size", "4", "--optim.mini_batch_size", "8",
         "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.val_every", "0"]


def _train(run: Path, capsys, *args: str) -> tuple[int, str, str]:
    """fastpo.train's main in this process (test_trainer._main): (exit status, stdout, stderr)."""
    from test_trainer import _main

    return _main([*SMALL, *args], run, capsys)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_truncate_after_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    logger = MetricsLogger(tmp_path, 0, console=False)
    for step in (0, 1, 2, 3):
        logger.log(step, {"x": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # the last line of a killed run
    assert logger.truncate_after(1) == 3
    logger.log(2, {"x": 20.0})
    logger.close()
    assert [(r["step"], r["x"]) for r in _rows(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    other_rank = MetricsLogger(tmp_path, 1, console=False)
    assert other_rank.truncate_after(-1) == 0 and len(_rows(tmp_path)) == 3


def test_claim_run_dir_refuses_resume_never_over_a_run_unless_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    claim_run_dir(run, "never", False)  # a new folder: fine, and created
    (run / "config.json").write_text("{}")  # a config alone (a run that died while loading) is no run
    claim_run_dir(run, "never", False)
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"trainer.resume=never but trainer.run_dir .* already holds a run \(.*"
                                          r"checkpoints, .*metrics.jsonl\); pass --trainer.overwrite true"):
        claim_run_dir(run, "never", False)
    claim_run_dir(run, "auto", False)  # continuing it is fine
    assert (run / "metrics.jsonl").is_file()
    claim_run_dir(run, "never", True)
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]
    assert "trainer.overwrite: deleted the previous run" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_never_refused_overwrite_starts_fresh_and_step0_row_has_its_timings(tmp_path, capsys):
    run = tmp_path / "run"
    rc, out, err = _train(run, capsys, "--trainer.iterations", "1")
    assert rc == 0, err[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert "timing/validate" in rows[0] and "timing/validate" not in rows[1]  # step 0's validation is not step 1's
    rc, out, err = _train(run, capsys, "--trainer.iterations", "1", "--trainer.resume", "never")
    assert rc == 2 and "already holds a run" in err and "--trainer.overwrite true" in err, err[-3000:]
    assert _rows(run) == rows and (run / "checkpoints" / "step-000001" / "COMPLETE").is_file()
    rc, out, err = _train(run, capsys, "--trainer.iterations", "1", "--trainer.resume", "never",
                          "--trainer.overwrite", "true")
    assert rc == 0, err[-3000:]
    assert [r["step"] for r in _rows(run)] == [0, 1]  # a fresh history, not two runs appended
    assert _rows(run)[1]["time"] > rows[1]["time"]


@pytest.mark.slow
def test_resume_after_a_kill_logs_each_step_once(tmp_path, capsys):
    """Killed after step 2's metrics line but before its checkpoint was published (plus a torn line): the resumed
    run replays step 2 from step 1's checkpoint, drops the stale rows and logs the same step 2 again."""
    run = tmp_path / "run"
    args = ["--trainer.val_before_train", "false", "--trainer.save_every", "1", "--trainer.deterministic", "true"]
    rc, _, err = _train(run, capsys, *args, "--trainer.iterations", "2")
    assert rc == 0, err[-3000:]
    before = _rows(run)
    assert [r["step"] for r in before] == [1, 2]
    subprocess.run(["rm", "-rf", str(run / "checkpoints" / "step-000002"), str(run / "hf")], check=True)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "actor/pg')
    rc, out, err = _train(run, capsys, *args, "--trainer.iterations", "3")
    assert rc == 0, err[-3000:]
    assert "resumed from step 1" in out and "metrics.jsonl: dropped 2 row(s) after step 1" in out
    after = _rows(run)
    assert [r["step"] for r in after] == [1, 2, 3]
    keys = [k for k in before[1] if k.startswith(("actor/", "rollout/reward"))]
    assert {k: after[1][k] for k in keys} == {k: before[1][k] for k in keys}
