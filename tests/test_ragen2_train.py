"""RAGEN-2's batch adjustment and advantage options inside one training iteration of the tiny agent (the rules
themselves are tested by hand in tests/test_rollout_filter.py and tests/test_algorithms.py)."""

from __future__ import annotations

import pytest
from test_filter_train import BASE, _iteration

from fastpo.config_load import parse_args
from fastpo.preflight import validate


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


@pytest.mark.slow
def test_entropy_filter_metric_reads_the_actors_token_entropy(tmp_path):
    """The entropy metric's input is each trajectory's mean token entropy over its trained tokens at the sampling
    temperature: checked against a plain forward of the actor; then one iteration filters on it."""
    import torch

    from fastpo.trainer import Trainer

    flags = ["--algorithm.rollout_filter_strategy", "top_k", "--algorithm.rollout_filter_value", "0.5",
             "--algorithm.rollout_filter_metric", "entropy", "--trainer.run_dir", str(tmp_path / "run")]
    cfg = validate(parse_args([*BASE, *flags]), 1)
    trainer = Trainer(cfg)
    try:
        trainer.step = 1
        trajs, _, _ = trainer._train_rollout()
        ents = trainer._entropies(trajs)
        assert ents.shape == (len(trajs),) and bool((ents > 0).all())
        for i in (0, len(trajs) - 1):
            t = trajs[i]
            ids = torch.as_tensor(t.input_ids, dtype=torch.int64)[None]
            with torch.no_grad():
                logits = trainer.actor(input_ids=ids).logits[0].float() / cfg.rollout.temperature
            logp = torch.log_softmax(logits, dim=-1)
            h = -(logp.exp() * logp).sum(-1)  # entropy of the next-token distribution at each position
            pos = torch.as_tensor(t.loss_mask).nonzero().squeeze(-1)
            assert float(ents[i]) == pytest.approx(float(h[pos - 1].mean()), rel=1e-4, abs=1e-5)
        row = trainer.iteration()
        assert row["rollout/kept_trajectories"] == 8 and row["rollout/filter_score_mean"] > 0
        assert row["rollout/chosen_filter_score_mean"] >= row["rollout/filter_score_mean"]  # the top half
    finally:
        trainer.close(export=False)
