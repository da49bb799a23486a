"""fastpo.report: the end-of-run success table, the training-curve PNG and the CLI, on hand-written metrics."""

from __future__ import annotations

import json

import pytest

from fastpo.report import (
    format_table,
    load_metrics,
    main,
    plot_curves,
    success_table,
    val_success_mean,
    write_report,
)


def _write_run(tmp_path, rows, config=None):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "trunc')
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


ROWS = [
    {"step": 0, "val-env/FrozenLake/success": 0.25, "val-env/Sokoban/success": 0.5},
    {"step": 1, "rollout/reward": 0.1, "env/FrozenLake/success": 0.2, "actor/entropy": 1.0, "actor/grad_norm": 0.5,
     "rollout/in_group_std": 0.3},
    {"step": 2, "rollout/reward": 0.4, "env/FrozenLake/success": 0.35, "actor/entropy": 0.9, "actor/grad_norm": None,
     "rollout/in_group_std": 0.2, "val-env/FrozenLake/success": 0.375},
    {"step": 3, "rollout/reward": 0.5, "env/FrozenLake/success": 0.4, "actor/entropy": 0.8, "actor/grad_norm": 0.7,
     "rollout/in_group_std": 0.1, "val-env/FrozenLake/success": 0.5, "val-env/Sokoban/success": None},
]


def test_success_table_first_and_last_validation(tmp_path):
    rows = load_metrics(_write_run(tmp_path, ROWS))
    assert len(rows) == 4  # the truncated last line is skipped
    table = success_table(rows)
    assert [t.env for t in table] == ["FrozenLake", "Sokoban"]
    fl, sok = table
    assert (fl.before, fl.after, fl.before_step, fl.after_step) == (0.25, 0.5, 0, 3)
    assert fl.delta_points == pytest.approx(25.0)
    # the non-finite (None) value at step 3 is ignored: Sokoban validated once
    assert (sok.before, sok.after, sok.after_step) == (0.5, 0.5, 0)
    text = format_table(table, n_val=256)
    assert "256 fixed initial states" in text and "+25.0 pt" in text and "50.0%" in text


def test_val_success_mean_over_envs_skips_non_finite():
    assert val_success_mean(ROWS[0]) == pytest.approx(0.375)  # (0.25 + 0.5) / 2
    assert val_success_mean(ROWS[1]) is None  # a training row: env/... is not val-env/...
    assert val_success_mean(ROWS[3]) == pytest.approx(0.5)  # Sokoban's None is not counted as 0
    assert val_success_mean({"step": 4, "val-env/A/success": float("nan"), "val-env/A/success_rate": 1.0}) is None
    assert val_success_mean({"step": 5, "val-env/A/success": True}) is None  # a bool is not a success rate


def test_no_validation_says_so():
    assert success_table([{"step": 1, "rollout/reward": 0.0}]) == []
    assert "no validation results" in format_table([])


def test_png_is_a_valid_image(tmp_path):
    import matplotlib.image

    out = plot_curves(ROWS, tmp_path / "sub" / "curves.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 200 and img.shape[1] > 1000 and img.std() > 0.01  # drawn, not blank


def test_write_report_and_cli(tmp_path, capsys):
    run = _write_run(tmp_path, ROWS, {"env": {"names": ["frozenlake"], "val_names": [], "val_groups": 256,
                                              "val_group_size": 1}})
    text = write_report(run)
    assert "256 fixed initial states" in text and "FrozenLake" in text
    assert "Hugging Face export: none" in text  # no hf/ folder: the run did not finish
    assert (run / "curves.png").stat().st_size > 0 and (run / "report.txt").read_text().strip() == text
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")
    (run / "hf" / "COMPLETE").write_text("{}")  # fastpo.checkpoint.export_hf's marker: the export finished
    assert main([str(run)]) == 0
    assert f"Hugging Face export: {run / 'hf'}" in capsys.readouterr().out


def test_missing_run_dir_is_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl not found" in err and "--trainer.run_dir" in err and err.count("\n") == 1


def test_compare_overlays_runs(tmp_path, capsys):
    import matplotlib.image

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _write_run(tmp_path / "a", ROWS)
    collapsing = [dict(r) for r in ROWS]
    collapsing[3] = {**collapsing[3], "rollout/in_group_std": 0.0, "actor/entropy": 0.05,
                     "val-env/FrozenLake/success": 0.0}
    b = _write_run(tmp_path / "b", collapsing)
    out = tmp_path / "pair.png"
    assert main([str(a), str(b), "--compare", str(out), "--labels", "stable,collapses"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("stable:") and "collapses:" in text and "-25.0 pt" in text and f"wrote {out}" in text
    img = matplotlib.image.imread(out)
    assert img.shape[1] > 1000 and img.std() > 0.01
    assert main([str(a), str(b), "--compare", str(out), "--labels", "one"]) == 2
    assert main([str(a), str(b)]) == 2 and "--compare" in capsys.readouterr().err


@pytest.mark.parametrize("content,words", [
    (bytes(range(256)) * 8, ["metrics.jsonl", "line 2", "not UTF-8 text"]),  # line 1: bytes 0-9
    (b'{"step": 0}\n{"step": "three", "rollout/reward": 1}\n', ["metrics.jsonl", "line 2", "step", "'three'",
                                                                "integer"]),
    (b'{"step": 1.5}\n', ["line 1", "step", "1.5"]),
], ids=["binary", "text_step", "float_step"])
def test_unreadable_metrics_are_one_line_errors(tmp_path, capsys, content, words):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and len(err) < 400, err
    for word in words:
        assert word in err, err


def test_a_torn_multibyte_last_line_is_skipped_and_a_deep_config_ignored(tmp_path):
    good = json.dumps({"step": 0, "val-env/FrozenLake/success": 0.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_bytes(good.encode() + '{"step": 1, "note": "é'.encode()[:-1])
    (tmp_path / "config.json").write_text('{"env": ' + "[" * 5000 + "]" * 5000 + "}")
    assert len(load_metrics(tmp_path)) == 1
    assert "validation success" in write_report(tmp_path)
