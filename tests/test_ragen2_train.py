"""RAGEN-2's batch adjustment and advantage options inside one training iteration of the tiny agent (the rules
themselves are tested by hand in tests/test_rollout_filter.py and tests/test_algorithms.py)."""

from __future__ import annotations

import pytest
from test_filter_train import BASE

from fastpo.config import parse_args, validate


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
def test_batch_adjust_copies_or_deletes_to_the_divisor(tmp_path):
    """top_k 0.75 of 4 groups of 4 keeps 12 trajectories; with mini-batch 8 the divisor is lcm(4, 8, 1) = 8:
    copy trains 16, delete 8, none 12."""
    flags = ["--algorithm.rollout_filter_strategy", "top_k", "--algorithm.rollout_filter_value", "0.75",
             "--optim.mini_batch_size", "8"]
    for mode, size in (("copy", 16), ("delete", 8)):
        row = _iteration(tmp_path, mode, *flags, "--algorithm.batch_adjust_mode", mode)
        assert row["rollout/kept_trajectories"] == 12 and row["rollout/adjusted_batch_size"] == size
    assert "rollout/adjusted_batch_size" not in _iteration(tmp_path, "none", *flags)


@pytest.mark.slow
def test_zero_task_advantage_in_the_trainer(tmp_path):
    """The same rollout (same seeds) trains with non-zero advantages without the option and all-zero ones with it."""
    base = _iteration(tmp_path, "base")
    row = _iteration(tmp_path, "zero", "--algorithm.zero_task_advantage", "true")
    assert base["critic/advantages/max"] > 0 and row["rollout/reward"] == base["rollout/reward"]
    assert row["critic/advantages/max"] == 0.0 and row["critic/advantages/min"] == 0.0
