"""What the console shows while a run happens: progress bars (train, resumed train, SFT, eval) and the line after
each validation (success per env and its change since the run's first validation, kept across a resume)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import fastpo
from fastpo import progress
from fastpo.metrics import MetricsLogger, first_validation, validation_line, validation_successes


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_validation_line_shows_success_and_change_in_points():
    start = {"FrozenLake": 0.4727, "Sokoban": 0.281}
    now = {"FrozenLake": 0.5234, "Sokoban": 0.301}
    assert validation_line(40, 150, now, start) == "val 40/150  FrozenLake 52.3% (+5.1)  Sokoban 30.1% (+2.0)"
    assert validation_line(60, 150, {"FrozenLake": 0.40}, start) == "val 60/150  FrozenLake 40.0% (-7.3)"
    # an env without a reference (validated for the first time) shows no change; no total: no "/N"
    assert validation_line(0, None, {"Bandit": 0.5}, start) == "val 0  Bandit 50.0%"


def test_validation_successes_reads_only_finite_success_keys():
    metrics = {"val-env/FrozenLake/success": 0.5, "val-env/FrozenLake/action_is_valid": 0.9,
               "rollout/success": 0.1, "val-env/Sokoban/success": float("nan"), "val-env/Bandit/success": None,
               "val-env/Countdown/success": 1}
    assert validation_successes(metrics) == {"FrozenLake": 0.5, "Countdown": 1.0}


def test_validation_lines_keep_the_start_across_a_resume(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, rank=0, stream=out, total_steps=30)
    logger.log(0, {"val-env/FrozenLake/success": 0.25})
    logger.log(1, {"rollout/reward": 0.1})
    logger.log(10, {"rollout/reward": 0.2, "val-env/FrozenLake/success": 0.375})
    logger.close()
    lines = out.getvalue().splitlines()
    assert lines[1] == "val 0/30  FrozenLake 25.0% (+0.0)"
    assert lines[2].startswith("step      1 | reward 0.100")
    assert lines[4] == "val 10/30  FrozenLake 37.5% (+12.5)"
    assert first_validation(tmp_path / "metrics.jsonl") == {"FrozenLake": 0.25}
    # a new process resumes after step 10: the change is still measured from step 0's validation
    out = io.StringIO()
    resumed = MetricsLogger(tmp_path, rank=0, stream=out, total_steps=30)
    resumed.start_progress(10)
    resumed.log(20, {"val-env/FrozenLake/success": 0.5})
    resumed.close()
    assert out.getvalue().splitlines()[-1] == "val 20/30  FrozenLake 50.0% (+25.0)"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 10, 20]


def test_resumed_bar_starts_at_the_resumed_step(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.ENV_VAR, "1")
    bar_out, out = io.StringIO(), io.StringIO()
    logger = MetricsLogger(tmp_path, rank=0, stream=out, jsonl=False, total_steps=150, progress_stream=bar_out)
    logger.start_progress(40)
    assert logger._bar.n == 40 and logger._bar.total == 150
    assert "40/150" in bar_out.getvalue()
    logger.log(41, {"rollout/reward": 1.0})
    assert logger._bar.n == 41
    logger.close()  # draws the final state (tqdm rate-limits redraws to one per 0.1 s)
    assert "41/150" in bar_out.getvalue()
    assert "step     41 | reward 1.000" in out.getvalue() and "41/150" not in out.getvalue()  # bar: stderr only
    assert progress.start_position(40, 150) == 40
    assert progress.start_position(200, 150) == 150 and progress.start_position(-3, 150) == 0


def test_validation_at_step_zero_does_not_count_as_an_iteration(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.ENV_VAR, "1")
    bar_out = io.StringIO()
    logger = MetricsLogger(tmp_path, rank=0, stream=io.StringIO(), jsonl=False, total_steps=4,
                           progress_stream=bar_out)
    logger.log(0, {"val-env/FrozenLake/success": 0.5})
    assert logger._bar.n == 0
    logger.log(1, {"rollout/reward": 1.0})
    assert logger._bar.n == 1
    logger.close()
    assert "| 1/4 [" in bar_out.getvalue() and "2/4" not in bar_out.getvalue()


def test_when_a_bar_is_drawn(monkeypatch):
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    assert progress.progress_enabled(_Tty(), rank=0)
    assert not progress.progress_enabled(io.StringIO(), rank=0)  # CI logs, pipes: no carriage returns
    assert not progress.progress_enabled(_Tty(), rank=1)
    monkeypatch.setenv(progress.ENV_VAR, "1")
    assert progress.progress_enabled(io.StringIO(), rank=0) and not progress.progress_enabled(_Tty(), rank=1)
    monkeypatch.setenv(progress.ENV_VAR, "0")
    assert not progress.progress_enabled(_Tty(), rank=0)
    monkeypatch.setenv(progress.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="FASTPO_PROGRESS='sometimes': expected auto, 1 or 0"):
        progress.progress_enabled(_Tty(), rank=0)
    monkeypatch.setenv(progress.ENV_VAR, "0")
    bar = progress.progress_bar(10, stream=_Tty())
    bar.update(3)
    bar.close()  # a disabled bar is tqdm's no-op bar


@pytest.mark.slow
def test_sft_and_eval_bars(monkeypatch, capsys):
    from fastpo.eval import evaluate
    from fastpo.model import load_policy, load_tokenizer
    from fastpo.sft_core import build_sft_dataset, train_sft

    path = Path(fastpo.__file__).parent / "assets" / "tiny-agent"  # the shipped agent: nothing to build
    tok = load_tokenizer(path)
    monkeypatch.setenv(progress.ENV_VAR, "1")
    model = load_policy(path)
    data = build_sft_dataset("bandit", 4, seed=1, noise=0.0, tokenizer=tok)
    train_sft(model, data, 3, batch_size=2, pad_token_id=tok.pad_token_id, progress=True)
    evaluate(model, tok, "bandit", n=6, batch_size=4, max_new_tokens=4, progress=True)
    err = capsys.readouterr().err
    assert "sft: 100%" in err and "3/3" in err
    assert "eval Bandit: 100%" in err and "6/6" in err and "4/6" in err  # advances per batch of 4
    train_sft(model, data, 2, batch_size=2, pad_token_id=tok.pad_token_id)  # library default: no bar
    evaluate(model, tok, "bandit", n=2, batch_size=2, max_new_tokens=4)
    assert capsys.readouterr().err == ""
