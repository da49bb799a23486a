"""algorithm.old_logprobs=engine: PPO's old logprobs taken from the sampler instead of a scoring forward.

In-process trainer runs on the tiny preset shrunk as in test_trainer.py, with mini-batches of 4 of the 8 kept
trajectories (2 optimiser steps per iteration, so the update is not on-policy and the old logprobs matter)."""

import numpy as np
import pytest
import torch
from test_trainer import train_iterations

from fastpo import update
from fastpo.config_load import parse_args
from fastpo.preflight import validate
from fastpo.rollout import Trajectory
from fastpo.trainer import Trainer, TrainingAborted

SMALL = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.val_groups", "4",
         "--env.env_groups", "4", "--env.group_size", "4", "--optim.mini_batch_size", "4",
         "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.iterations", "1",
         "--trainer.val_before_train", "false", "--trainer.val_every", "0"]


_SCORE = Trainer._score  # the unpatched method (each run installs its own spy over it)


def _traj(mask, logps, exact=True):
    n = len(mask)
    return Trajectory(group=0, seed=0, input_ids=np.arange(n), loss_mask=np.array(mask, bool),
                      sample_logprobs=np.array(logps, np.float32), token_rewards=np.zeros(n, np.float32),
                      turn_end=np.zeros(n, bool), reward=0.0, logprobs_exact=exact)


def test_take_engine_logprobs_returns_exact_ones_and_the_rest():
    trajs = [_traj([0, 1, 1], [0.0, -0.5, -1.5]), _traj([0, 1], [0.0, -2.0], exact=False),
             _traj([0, 0, 1, 0], [0.0, -9.0, -0.25, -3.0]), _traj([1], [-0.1])]
    old, rest = update.take_engine_logprobs(trajs, [0, 1, 2])
    assert rest == [1] and sorted(old) == [0, 2]
    np.testing.assert_array_equal(old[0], np.array([0.0, -0.5, -1.5], np.float32))
    # a stray value off the loss mask is not carried into the old logprobs (the scoring pass leaves 0 there)
    np.testing.assert_array_equal(old[2], np.array([0.0, 0.0, -0.25, 0.0], np.float32))
    assert old[2].dtype == np.float32
    assert all(t.old_logp is None for t in trajs)  # values returned; the input trajectories are not written
    trajs[0].sample_logprobs[1] = 5.0
    assert old[0][1] == np.float32(-0.5)  # a copy, not a view
    batch = update.with_fields(trajs, {j: {"old_logp": v} for j, v in old.items()})
    assert batch[0].old_logp is old[0] and batch[1] is trajs[1] and trajs[0].old_logp is None


def _first_update(tmp_path, monkeypatch, run: str, *extra: str, score_every_row: bool = False):
    """One iteration; returns its metrics, the actor's weights after it and the (actor, extras, n) of each
    scoring call. ``score_every_row``: the trainer scores the first mini-batch too (the "trainer" source) instead
    of taking its old logprobs from the update's first forward ("first-update"), the reference these tests
    compare the sampler's logprobs with."""
    calls = []
    if score_every_row:
        source = update.old_logprob_source
        monkeypatch.setattr(update, "old_logprob_source",
                            lambda *a, **k: "trainer" if source(*a, **k) == "first-update" else source(*a, **k))

    def spy(self, trajs, kept, actor=True, extras=True):
        calls.append((actor, extras, len(kept)))
        return _SCORE(self, trajs, kept, actor, extras)

    monkeypatch.setattr(Trainer, "_score", spy)
    rows, weights = train_iterations(
        validate(parse_args([*SMALL, *extra, "--trainer.run_dir", str(tmp_path / run)]), 1))
    return rows[0], weights, calls


@pytest.mark.slow
def test_engine_old_logprobs_skip_the_scoring_forward_and_match_it(tmp_path, monkeypatch):
    m_eng, w_eng, c_eng = _first_update(tmp_path, monkeypatch, "engine", "--algorithm.old_logprobs", "engine")
    m_ref, w_ref, c_ref = _first_update(tmp_path, monkeypatch, "trainer", "--algorithm.old_logprobs", "trainer",
                                        score_every_row=True)
    assert m_ref["rollout/kept_trajectories"] == 8 and c_ref == [(True, True, 8)]
    assert c_eng == [(False, True, 8)]  # no actor forward: every sample logprob is exact (KV-reuse rollout)
    # the gap guard measured on the first optimiser step's forward, against the same weights as the scoring pass
    assert 0 < m_eng["rollout/logprob_gap_mean"] < 1e-4 and m_ref["rollout/logprob_gap_mean"] < 1e-4
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert m_eng[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    # Adam's first steps are ~lr * sign(grad) (lr 3e-4): where a gradient is ~0 the ~1e-7 difference in the old
    # logprobs can move an element's step; bound every element by lr and require almost all to agree far closer
    for k in w_ref:
        torch.testing.assert_close(w_eng[k], w_ref[k], atol=3e-4, rtol=0)
        assert ((w_eng[k] - w_ref[k]).abs() > 1e-5).float().mean() < 1e-3, k
    assert max((w_ref[k] - w0).abs().max().item() for k, w0 in _initial_weights().items()) > 1e-4


def _initial_weights():
    from safetensors.torch import load_file

    from fastpo.tiny_agent import tiny_agent_path

    return {k: v for k, v in load_file(str(tiny_agent_path() / "model.safetensors")).items()}


@pytest.mark.slow
def test_inexact_sample_logprobs_are_still_scored(tmp_path, monkeypatch):
    """rollout.canonical: every trajectory's sample logprobs are inexact, so engine mode scores them all with the
    trainer and its update is the trainer mode's, bit for bit."""
    m_eng, w_eng, c_eng = _first_update(tmp_path, monkeypatch, "engine", "--rollout.canonical", "true",
                                        "--algorithm.old_logprobs", "engine")
    m_ref, w_ref, c_ref = _first_update(tmp_path, monkeypatch, "trainer", "--rollout.canonical", "true",
                                        "--algorithm.old_logprobs", "trainer", score_every_row=True)
    assert c_eng == [(False, True, 8), (True, False, 8)] and c_ref == [(True, True, 8)]
    assert "rollout/logprob_gap_mean" not in m_eng  # no exact token to measure on
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert m_eng[key] == m_ref[key], key
    assert all(torch.equal(w_eng[k], w_ref[k]) for k in w_ref)


@pytest.mark.slow
def test_engine_gap_guard_stops_before_the_weights_move(tmp_path):
    cfg = validate(parse_args([*SMALL, "--algorithm.old_logprobs", "engine", "--trainer.logprob_gap_max", "1e-12",
                               "--trainer.run_dir", str(tmp_path / "guard")]), 1)
    trainer = Trainer(cfg)
    trainer.step = 1
    before = {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}
    try:
        with pytest.raises(TrainingAborted, match=r"step 1: mean \|engine logp - trainer logp\|.*gap_max=1e-12"):
            trainer.iteration()
        assert all(torch.equal(v, before[k]) for k, v in trainer.actor.state_dict().items())
    finally:
        trainer.close(export=False)
