"""RAGEN-2's rollout filter family in the trainer (``algorithm.rollout_filter_strategy``): config errors before any
model loads, the kept groups of one iteration, the empty-filter stop and the advantage scaling by the kept share.
The selection rules themselves are tested against hand-computed cases in tests/test_rollout_filter.py."""

from __future__ import annotations

import pytest
from test_trainer import SMALL

from fastpo.config import ConfigError
from fastpo.config_load import parse_args
from fastpo.preflight import validate
from fastpo.presets import get_preset

BASE = [*SMALL, "--trainer.val_before_train", "false", "--trainer.val_every", "0", "--trainer.save_every", "0",
        "--algorithm.adv_estimator", "grpo", "--optim.mini_batch_size", "4"]


@pytest.mark.parametrize("changes,message", [
    ({"rollout_filter_strategy": "top_q"}, "algorithm.rollout_filter_strategy: unknown 'top_q'"),
    ({"rollout_filter_strategy": "top_k", "rollout_filter_value": 1.5},
     r"algorithm.rollout_filter_value for top_k must lie in \(0, 1\], got 1.5"),
    ({"rollout_filter_strategy": "top_k_abs", "rollout_filter_value": 0.5},
     "algorithm.rollout_filter_value for top_k_abs is a group count"),
    ({"rollout_filter_strategy": "top_p", "rollout_filter_metric": "rewrd"}, "rollout_filter_metric: unknown 'rewrd'"),
    ({"rollout_filter_strategy": "min_p", "refill_rounds": 2}, "works with the legacy filter only"),
    ({"rollout_filter_empty_stop_steps": -1}, "rollout_filter_empty_stop_steps must be >= 0"),
    ({"rollout_filter_strategy": "top_p", "rollout_filter_selection_eps": -0.1},
     "rollout_filter_selection_eps must be a finite number >= 0"),
])
def test_bad_filter_settings_are_config_errors(changes, message):
    cfg = get_preset("tiny")
    for key, value in changes.items():
        setattr(cfg.algorithm, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


def _iteration(tmp_path, name: str, *flags: str) -> dict:
    from fastpo.trainer import Trainer

    cfg = validate(parse_args([*BASE, *flags, "--trainer.run_dir", str(tmp_path / name)]), 1)
    trainer = Trainer(cfg)
    try:
        trainer.step = 1
        return trainer.iteration()
    finally:
        trainer.close(export=False)


@pytest.mark.slow
def test_top_k_keeps_its_share_and_loss_scaling_scales_the_advantages(tmp_path):
    """top_k 0.5 over 4 groups keeps 2 groups (8 trajectories); filter_loss_scaling linear multiplies every
    advantage by the kept share (0.5), sqrt by its root, and leaves the rollout unchanged."""
    flags = ["--algorithm.rollout_filter_strategy", "top_k", "--algorithm.rollout_filter_value", "0.5"]
    rows = {mode: _iteration(tmp_path, mode, *flags, "--algorithm.filter_loss_scaling", mode)
            for mode in ("none", "linear", "sqrt")}
    none = rows["none"]
    assert none["rollout/kept_trajectories"] == 8 and none["rollout/kept_group_fraction"] == 0.5
    assert none["critic/advantages/max"] > 0
    for mode, factor in (("linear", 0.5), ("sqrt", 0.5 ** 0.5)):
        assert rows[mode]["rollout/reward"] == none["rollout/reward"]
        assert rows[mode]["critic/advantages/max"] == pytest.approx(factor * none["critic/advantages/max"], rel=1e-6)


@pytest.mark.slow
def test_empty_filter_stop_ends_the_run(tmp_path, monkeypatch):
    """Iterations whose filter keeps nothing skip the update; rollout_filter_empty_stop_steps of them in a row stop
    the run (TrainingAborted: exit 1), and the count is in the trainer's checkpointed state. The filter is made to
    keep nothing by zeroing the real selection (whether a policy gives such batches is the data's business)."""
    from fastpo import rollout_filter
    from fastpo.trainer import Trainer, TrainingAborted

    real = rollout_filter.select_groups

    def nothing(*args, **kwargs):
        keep, metrics = real(*args, **kwargs)
        return keep & False, metrics

    monkeypatch.setattr(rollout_filter, "select_groups", nothing)
    flags = ["--algorithm.rollout_filter_strategy", "top_p", "--algorithm.rollout_filter_empty_stop_steps", "2"]
    cfg = validate(parse_args([*BASE, *flags, "--trainer.run_dir", str(tmp_path / "run")]), 1)
    trainer = Trainer(cfg)
    try:
        trainer.step = 1
        assert trainer.iteration()["rollout/kept_trajectories"] == 0 and trainer.state_dict()["empty_filter_steps"] == 1
        trainer.step = 2
        with pytest.raises(TrainingAborted, match="kept no group in 2 iterations in a row"):
            trainer.iteration()
    finally:
        trainer.close(export=False)
