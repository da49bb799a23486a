"""fastpo.update: the update's numerics called directly on hand-made trajectories (no Trainer)."""

import math

import numpy as np
import pytest
import torch

from fastpo import algorithms, update
from fastpo.config import AlgorithmConfig
from fastpo.rollout import Trajectory


def _trajs():
    """Two groups of two: group 0 rewards 1 / 0, group 1 rewards 2 / 2 (zero std)."""
    out = []
    for group, reward, n in ((0, 1.0, 6), (0, 0.0, 4), (1, 2.0, 5), (1, 2.0, 7)):
        mask = np.arange(n) >= 2
        rewards = np.zeros(n, np.float32)
        rewards[n - 1] = reward
        out.append(Trajectory(np.arange(n), mask, token_rewards=rewards, group=group, reward=reward,
                              sample_logprobs=-np.ones(n, np.float32) * mask))
    return out


def test_advantages_are_the_estimator_on_the_packed_kept_batch():
    trajs = _trajs()
    kept = [0, 1, 3]
    adv, ret, metrics = update.advantages(trajs, kept, AlgorithmConfig(adv_estimator="grpo"), with_values=False)
    assert ret is None and metrics == {} and [len(a) for a in adv] == [6, 4, 7]
    # GRPO within group 0: (1 - 0.5) / std([1, 0], ddof 1) on the trained tokens; group 1 has one kept member: 0
    std = np.std([1.0, 0.0], ddof=1)
    np.testing.assert_allclose(adv[0], np.where(trajs[0].loss_mask, 0.5 / (std + 1e-6), 0.0), rtol=1e-6)
    np.testing.assert_allclose(adv[1], np.where(trajs[1].loss_mask, -0.5 / (std + 1e-6), 0.0), rtol=1e-6)
    np.testing.assert_array_equal(adv[2], np.zeros(7, np.float32))
    # the same as the registry on a batch packed by hand
    cu = torch.tensor([0, 6, 10, 17])
    batch = algorithms.PackedBatch(
        token_rewards=torch.from_numpy(np.concatenate([trajs[i].token_rewards for i in kept])),
        loss_mask=torch.from_numpy(np.concatenate([trajs[i].loss_mask for i in kept])),
        turn_end=torch.zeros(17, dtype=torch.bool), cu_seqlens=cu, scores=torch.tensor([1.0, 0.0, 2.0]),
        group_ids=torch.tensor([0, 0, 1]))
    ref, _ = algorithms.compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"))
    np.testing.assert_array_equal(np.concatenate(adv), ref.numpy())


def test_gae_reads_values_and_returns_returns():
    trajs = _trajs()
    for t in trajs:
        t.values = (0.25 * t.loss_mask).astype(np.float32)
    adv, ret, _ = update.advantages(trajs, [0, 1], AlgorithmConfig(adv_estimator="gae"), with_values=True)
    assert ret is not None
    # gamma = lam = 1: return = the trajectory reward on every trained token, advantage = return - value (whitened)
    np.testing.assert_allclose(ret[0][trajs[0].loss_mask], 1.0)
    np.testing.assert_allclose(ret[1][trajs[1].loss_mask], 0.0)
    raw = np.concatenate([np.full(4, 0.75), np.full(2, -0.25)])
    np.testing.assert_allclose(np.concatenate([adv[0][2:], adv[1][2:]]), (raw - raw.mean()) / raw.std(ddof=1),
                               rtol=1e-4, atol=1e-5)


def test_logprob_gap_counts_exact_trained_tokens_only():
    trajs = _trajs()
    for t in trajs:
        t.old_logp = (-0.9 * t.loss_mask).astype(np.float32)
    trajs[1].logprobs_exact = False  # its sample logprobs belong to other tokens
    gap = update.logprob_gap(trajs, [0, 1, 2], train_on_observations=False)
    assert gap["rollout/logprob_gap_mean"] == pytest.approx(0.1, rel=1e-5)
    assert gap["rollout/logprob_gap_max"] == pytest.approx(0.1, rel=1e-5)
    assert update.logprob_gap(trajs, [1], False) == {} and update.logprob_gap(trajs, [0], True) == {}


def test_loss_scales_and_on_policy():
    from fastpo.microbatch import pack

    trajs = _trajs()
    micro = pack(trajs, [0, 1, 2], 10, torch.device("cpu"))
    assert [mb.indices for mb in micro] == [[0, 1], [2]]
    tokens = [int(trajs[i].loss_mask.sum()) for i in (0, 1, 2)]  # 4, 2, 3
    assert update.loss_scales(trajs, [0, 1, 2], micro, "token-mean", 2) == pytest.approx(
        [(tokens[0] + tokens[1]) / sum(tokens) * 2, tokens[2] / sum(tokens) * 2])
    assert update.loss_scales(trajs, [0, 1, 2], micro, "seq-mean-token-mean", 1) == pytest.approx([2 / 3, 1 / 3])
    assert update.loss_scales(trajs, [0, 1, 2], micro, "seq-mean-token-sum-norm", 2) == [2.0, 2.0]
    assert update.norm_len(trajs, [0, 1, 2]) == 6.0
    assert update.is_on_policy([0, 1, 2], 3, 1) and not update.is_on_policy([0, 1, 2], 2, 1)
    assert not update.is_on_policy([0], 8, 2)


def test_clip_and_step_skips_a_non_finite_step():
    model = torch.nn.Linear(3, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    norm, ok = update.clip_and_step(model, optim, sched, float("nan"), grad_clip=1.0)
    assert not ok and math.isfinite(norm) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model(torch.ones(1, 3)).sum().backward()
    norm, ok = update.clip_and_step(model, optim, sched, 1.0, grad_clip=0.5)
    assert ok and norm == pytest.approx(2.0)  # |d/dw| = 1 for 3 weights and the bias: norm 2, clipped to 0.5
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_metric_means_average_over_steps():
    assert update.metric_means({"actor/pg_loss": 3.0}, world=1, steps=3) == {"actor/pg_loss": 1.0}


def test_set_grad_sync_defers_the_reduction_to_the_last_backward():
    """optim.defer_grad_sync's mechanism on a real FSDP2 module (world-1 gloo group): with sync off, a backward
    leaves the weights gathered with their gradients accumulating unsharded; the backward with sync on reshards and
    delivers the sum of all three to the sharded gradient."""
    from torch.distributed.fsdp import fully_shard

    from fastpo import distributed as du
    from fastpo import fsdp

    update.set_grad_sync(torch.nn.Linear(2, 2), False)  # not sharded: a no-op, no error
    assert fsdp.init_single_rank_group("cpu")
    try:
        torch.manual_seed(0)
        plain = torch.nn.Linear(4, 3)
        xs = [torch.randn(5, 4) for _ in range(3)]
        expected = sum(torch.autograd.grad(plain(x).square().sum(), plain.weight)[0] for x in xs)
        model = fully_shard(torch.nn.Sequential(plain))
        for j, x in enumerate(xs):
            update.set_grad_sync(model, j == len(xs) - 1)
            model(x).square().sum().backward()
            if j < len(xs) - 1:  # deferred: the weight stays gathered (a plain tensor), not resharded to a DTensor
                assert not hasattr(model[0].weight, "full_tensor"), j
        torch.testing.assert_close(model[0].weight.grad.full_tensor(), expected, rtol=1e-6, atol=1e-6)
    finally:
        du.shutdown()


def test_old_logprob_source_is_decided_in_one_place():
    """One epoch over one mini-batch -> the update's own forward; else the sampler's logprobs with
    old_logprobs=engine; else, in one epoch, the update's forward for the first mini-batch and a scoring pass for
    the rest; else (several epochs, or every row needed before the update) the trainer's scoring pass."""
    from types import SimpleNamespace

    one_step = SimpleNamespace(mini_batch_size=8, ppo_epochs=1)
    assert update.old_logprob_source(list(range(8)), one_step, AlgorithmConfig()) == "update"
    assert update.old_logprob_source(list(range(8)), one_step, AlgorithmConfig(old_logprobs="engine")) == "update"
    assert update.old_logprob_source(list(range(9)), one_step, AlgorithmConfig(old_logprobs="engine")) == "sampler"
    assert update.old_logprob_source(list(range(9)), one_step, AlgorithmConfig()) == "first-update"
    assert update.old_logprob_source(list(range(9)), one_step, AlgorithmConfig(), every_row=True) == "trainer"
    assert update.old_logprob_source(list(range(8)), one_step, AlgorithmConfig(), every_row=True) == "update"
    two_epochs = SimpleNamespace(mini_batch_size=8, ppo_epochs=2)
    assert update.old_logprob_source(list(range(4)), two_epochs, AlgorithmConfig()) == "trainer"
    assert update.old_logprob_source(list(range(20)), two_epochs, AlgorithmConfig()) == "trainer"


def test_first_mini_batch_is_the_training_loops_first():
    from types import SimpleNamespace

    for shuffle in (False, True):
        optim = SimpleNamespace(mini_batch_size=4, shuffle_mini_batches=shuffle)
        kept = list(range(3, 14))
        first = update.first_mini_batch(kept, optim, seed=7, step=5)
        assert first == update.mini_batches(kept, 4, shuffle, 7, 5, 0)[0] and len(first) == 4
    assert update.first_mini_batch(list(range(10)), SimpleNamespace(mini_batch_size=4, shuffle_mini_batches=False),
                                   seed=0, step=1) == [0, 1, 2, 3]


def test_reduce_gap_adds_the_scored_rows_after_the_ranks():
    assert update.reduce_gap(3.0, 2, 2.5, prior=(1.0, 2, 0.5)) == {"rollout/logprob_gap_mean": 1.0,
                                                                    "rollout/logprob_gap_max": 2.5}
    assert update.reduce_gap(0.0, 0, 0.0, prior=(0.9, 3, 0.6)) == pytest.approx(
        {"rollout/logprob_gap_mean": 0.3, "rollout/logprob_gap_max": 0.6})
    assert update.reduce_gap(0.0, 0, 0.0) == {}
