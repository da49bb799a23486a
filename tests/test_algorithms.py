"""fastpo.algorithms: every estimator, filter and loss wrapper against hand-computed numbers (CPU, reference path)."""

import math

import numpy as np
import pytest
import torch

from fastpo import algorithms as alg
from fastpo.config import AlgorithmConfig


def whiten(x):
    """verl masked_whiten over all entries: (x - mean) / sqrt(unbiased var + 1e-8)."""
    x = torch.tensor(x, dtype=torch.float64)
    return ((x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)).float()


def packed(lengths, mask, rewards=None, values=None, turn_end=None, scores=None, group_ids=None):
    n = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int64)
    return alg.PackedBatch(
        token_rewards=torch.tensor(rewards if rewards is not None else [0.0] * n, dtype=torch.float32),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        turn_end=torch.tensor(turn_end if turn_end is not None else [False] * n, dtype=torch.bool),
        cu_seqlens=cu,
        scores=torch.tensor(scores if scores is not None else [0.0] * len(lengths), dtype=torch.float32),
        group_ids=torch.tensor(group_ids if group_ids is not None else list(range(len(lengths))), dtype=torch.int64),
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


# ------------------------------------------------------------------------------------------------ filters
# 4 groups of 4 returns; unbiased in-group std: G0 0, G1 sqrt(4/3), G2 sqrt(1/3), G3 2.
GROUP_RETURNS = {0: [1, 1, 1, 1], 1: [0, 0, 2, 2], 2: [0, 1, 0, 1], 3: [0, 0, 0, 4]}
STD = {0: 0.0, 1: math.sqrt(4 / 3), 2: math.sqrt(1 / 3), 3: 2.0}


def interleaved():
    """Trajectories in a shuffled order so group membership, not position, decides."""
    order = [(g, i) for i in range(4) for g in (2, 0, 3, 1)]
    scores = torch.tensor([GROUP_RETURNS[g][i] for g, i in order], dtype=torch.float32)
    gids = torch.tensor([g for g, _ in order])
    return scores, gids


@pytest.mark.parametrize("kind,ratio,kept", [
    ("std", 0.25, {3}), ("std", 0.5, {3, 1}), ("std", 0.75, {3, 1, 2}), ("std", 1.0, {0, 1, 2, 3}),
    ("std_rev", 0.25, {0}), ("std_rev", 0.5, {0, 2}), ("std_rev", 1.0, {0, 1, 2, 3}),
    ("nonzero", 0.25, {1, 2, 3}), ("nonzero", 1.0, {1, 2, 3}),
])
def test_filter_keeps_expected_groups(kind, ratio, kept):
    scores, gids = interleaved()
    keep, metrics = alg.filter_groups(scores, gids, ratio, kind)
    assert set(gids[keep].tolist()) == kept
    assert keep.sum().item() == 4 * len(kept)  # whole groups
    assert metrics["rollout/in_group_std"] == pytest.approx(sum(STD.values()) / 4, rel=1e-6)
    assert metrics["rollout/chosen_in_group_std"] == pytest.approx(sum(STD[g] for g in kept) / len(kept), rel=1e-6)
    assert metrics["rollout/kept_group_fraction"] == pytest.approx(len(kept) / 4)
    means = {g: sum(v) / 4 for g, v in GROUP_RETURNS.items()}
    assert metrics["rollout/chosen_in_group_mean"] == pytest.approx(sum(means[g] for g in kept) / len(kept))
    assert metrics["rollout/in_group_max"] == pytest.approx((1 + 2 + 1 + 4) / 4)


def test_filter_ties_go_to_lower_group_id():
    # groups 7 and 2 have the same std; keeping 1 of 2 must pick id 2, whatever the order of trajectories
    scores = torch.tensor([0.0, 1.0, 5.0, 6.0])
    for gids in ([7, 7, 2, 2], [2, 2, 7, 7]):
        keep, _ = alg.filter_groups(scores, torch.tensor(gids), 0.5, "std")
        assert torch.tensor(gids)[keep].tolist() == [2, 2]
        keep, _ = alg.filter_groups(scores, torch.tensor(gids), 0.5, "std_rev")
        assert torch.tensor(gids)[keep].tolist() == [2, 2]


def test_filter_rounds_like_ragen_and_rejects_zero_groups():
    assert alg.kept_group_count(8, 0.25, "std") == 2
    assert alg.kept_group_count(10, 0.25, "std") == 2  # int(2.5): floor, as RAGEN
    assert alg.kept_group_count(100, 0.29, "std") == 29  # plain int() would give 28
    assert alg.kept_group_count(8, 1.0, "std_rev") == 8
    assert alg.kept_group_count(8, 0.25, "nonzero") is None
    scores, gids = interleaved()
    with pytest.raises(ValueError, match="0 groups"):
        alg.filter_groups(scores, gids, 0.2, "std")  # int(0.2 * 4) = 0
    with pytest.raises(ValueError, match="rollout_filter_type"):
        alg.filter_groups(scores, gids, 0.5, "max_mean")
    with pytest.raises(ValueError, match="rollout_filter_ratio"):
        alg.filter_groups(scores, gids, 0.0, "std")


def test_filter_nonzero_may_keep_nothing():
    keep, metrics = alg.filter_groups(torch.ones(6), torch.tensor([0, 0, 1, 1, 2, 2]), 0.25, "nonzero")
    assert not keep.any()
    assert metrics["rollout/kept_group_fraction"] == 0.0 and metrics["rollout/chosen_in_group_std"] == 0.0


def test_group_of_one_has_zero_std():
    _, _, std, mean, gmax = alg.group_stats(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5, 9, 9]))
    assert std.tolist() == pytest.approx([0.0, math.sqrt(0.5)])
    assert mean.tolist() == [3.0, 1.5] and gmax.tolist() == [3.0, 2.0]


# --------------------------------------------------------------------------------------------- estimators
def test_gae_gamma_lam_one_is_return_minus_value_whitened():
    # seq 0: [obs, t, t, t] reward 2 on the last token; seq 1: [obs, t, t] reward -1 on the last token
    b = packed([4, 3], [0, 1, 1, 1, 0, 1, 1], rewards=[0, 0, 0, 2, 0, 0, -1],
               values=[9.0, 0.5, 1.0, 1.5, 7.0, 0.0, -0.5])
    adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="gae"))
    raw = [2 - 0.5, 2 - 1.0, 2 - 1.5, -1 - 0.0, -1 + 0.5]
    torch.testing.assert_close(adv[b.loss_mask], whiten(raw), atol=1e-5, rtol=1e-5)
    assert adv[~b.loss_mask].abs().max() == 0
    torch.testing.assert_close(ret[b.loss_mask], torch.tensor([2.0, 2, 2, -1, -1]))


def test_gae_requires_values():
    b = packed([2], [1, 1])
    with pytest.raises(ValueError, match="values"):
        alg.compute_advantages(b, AlgorithmConfig(adv_estimator="gae"))


def test_bilevel_gae_by_hand():
    # two turns of two trained tokens; turn rewards 0.5 and 1; V = 0.1 .. 0.4; gamma = lam = 1, gamma_high 0.95.
    # turn level: A2 = 1 - 0.4 = 0.6, G2 = 1.0; A1 = 0.5 + 0.95 * 0.4 - 0.2 + 0.95 * 0.6 = 1.25, G1 = 1.45.
    # token level (reward G_i on the turn's last token): [1.45 - 0.1, 1.45 - 0.2, 1.0 - 0.3, 1.0 - 0.4].
    b = packed([4], [1, 1, 1, 1], rewards=[0, 0.5, 0, 1], values=[0.1, 0.2, 0.3, 0.4], turn_end=[0, 1, 0, 1])
    adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="bilevel_gae", gamma_high=0.95))
    torch.testing.assert_close(adv, whiten([1.35, 1.25, 0.7, 0.6]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor([1.45, 1.45, 1.0, 1.0]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_by_hand(norm):
    # group 0: scores 1, 3 (mean 2, unbiased std sqrt 2); group 1: 2, 2 (zero advantage)
    b = packed([3, 2, 2, 3], [0, 1, 1, 1, 1, 0, 1, 0, 1, 1], scores=[1, 3, 2, 2], group_ids=[0, 0, 1, 1])
    adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=norm))
    a = 1 / (math.sqrt(2) + 1e-6) if norm else 1.0
    expected = torch.tensor([0, -a, -a, a, a, 0, 0, 0, 0, 0], dtype=torch.float32)
    torch.testing.assert_close(adv, expected)
    assert ret is None


def test_rloo_by_hand():
    # group 0: 1, 2, 6 -> 1 - 4, 2 - 3.5, 6 - 1.5; group 1 (one member): 0; group 2: 0, 4 -> -4, 4
    b = packed([2, 1, 1, 2, 1, 1], [1, 0, 1, 1, 1, 1, 1, 1], scores=[1, 2, 6, 5, 0, 4], group_ids=[0, 0, 0, 1, 2, 2])
    adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="rloo"))
    torch.testing.assert_close(adv, torch.tensor([-3.0, 0.0, -1.5, 4.5, 0.0, 0.0, -4.0, 4.0]))
    assert ret is None


@pytest.mark.parametrize("gamma,raw", [
    (1.0, [1.5, 1.5, 1.0, 1.0, -1.0, -1.0]),
    (0.5, [0.375, 0.75, 0.5, 1.0, -0.5, -1.0]),  # discount counts trained tokens only
])
def test_reinforce_pp_by_hand(gamma, raw):
    # seq 0: turn 1 (2 trained tokens, reward 0.5), observation (2 tokens), turn 2 (2 trained, reward 1)
    b = packed([6, 2], [1, 1, 0, 0, 1, 1, 1, 1], rewards=[0, 0.5, 0, 0, 0, 1, 0, -1])
    adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="reinforce_pp", gamma=gamma))
    torch.testing.assert_close(adv[b.loss_mask], whiten(raw), atol=1e-5, rtol=1e-5)
    assert adv[~b.loss_mask].abs().max() == 0 and ret is None


def test_needs_critic_and_reference():
    assert alg.needs_critic(AlgorithmConfig(adv_estimator="gae"))
    assert alg.needs_critic(AlgorithmConfig(adv_estimator="bilevel_gae"))
    for name in ("grpo", "rloo", "reinforce_pp"):
        assert not alg.needs_critic(AlgorithmConfig(adv_estimator=name))
    assert not alg.needs_reference(AlgorithmConfig())
    assert alg.needs_reference(AlgorithmConfig(kl_coef=0.001))
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        alg.needs_critic(AlgorithmConfig(adv_estimator="ppo"))


def test_register_custom_estimator_and_duplicates():
    @alg.register_adv_estimator("_test_const")
    def const(batch, cfg):
        return torch.where(batch.loss_mask, 1.0, 0.0), None

    try:
        adv, _ = alg.compute_advantages(packed([3], [0, 1, 1]), AlgorithmConfig(adv_estimator="_test_const"))
        assert adv.tolist() == [0.0, 1.0, 1.0]
        with pytest.raises(ValueError, match="already registered"):
            alg.register_adv_estimator("gae")(const)
    finally:
        del alg.ADV_ESTIMATORS["_test_const"]


# ------------------------------------------------------------------------------------------------ losses
def test_policy_loss_by_hand():
    # ratios 1.5, 0.9, 0.5, 5.0 with A = 1, 1, -1, -1 and eps 0.2 / 0.28, dual clip 3:
    # -1.28 (clipped), -0.9, 0.8 (clipped), min(5, 3) = 3 (dual clip); a 5th untrained token is ignored.
    ratio = torch.tensor([1.5, 0.9, 0.5, 5.0, 100.0])
    old = torch.full((5,), -1.0)
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 50.0])
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    entropy = torch.ones(5)
    ref = logp.detach() - 0.2  # k1 kl = 0.2 per token
    cfg = AlgorithmConfig(entropy_coef=0.001, kl_coef=0.1, kl_type="k1")
    loss, m = alg.policy_loss(logp, old, adv, mask, entropy, ref, cfg)
    assert loss.item() == pytest.approx((-1.28 - 0.9 + 0.8 + 3.0) / 4 + 0.1 * 0.2 - 0.001, abs=1e-5)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert m["actor/kl_loss"].item() == pytest.approx(0.2, abs=1e-6)
    assert m["actor/entropy"].item() == pytest.approx(1.0)
    assert m["actor/pg_loss"].item() == pytest.approx(loss.item())
    loss.backward()
    # untrained token: no gradient; clipped token: only the k1 KL term's kl_coef / 4; unclipped: -A r / 4 + that
    assert logp.grad[4] == 0
    assert logp.grad[0].item() == pytest.approx(0.1 / 4)
    assert logp.grad[1].item() == pytest.approx(-0.9 / 4 + 0.1 / 4)


def test_policy_loss_needs_ref_when_kl_on():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_logp"):
        alg.policy_loss(x, x, x, x.bool(), None, None, AlgorithmConfig(kl_coef=0.001))


def test_critic_loss_by_hand():
    # token 0: unclipped (1 - 0)^2 = 1 > clipped (0.5 - 0)^2; token 1: clipped (1.5 - 3)^2 = 2.25 > (2 - 3)^2
    values = torch.tensor([1.0, 2.0, 9.0], requires_grad=True)
    loss, m = alg.critic_loss(values, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 3.0, 0.0]),
                              torch.tensor([True, True, False]), AlgorithmConfig(value_clip=0.5))
    assert loss.item() == pytest.approx(0.5 * (1.0 + 2.25) / 2)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(0.5)
    assert m["critic/vf_loss"].item() == pytest.approx(loss.item())


# -------------------------------------------------------------------------------------------------- gigpo
def test_token_turn_ids_by_hand():
    # seq 0: [prompt, answer, answer|end, obs, answer|end, closing] 2 turns; seq 1: no turn; seq 2: 1 turn, the
    # closing text after its end included; seq 3: empty
    turn_end = torch.tensor([0, 0, 1, 0, 1, 0] + [0, 0] + [0, 1, 0], dtype=torch.bool)
    cu = torch.tensor([0, 6, 8, 11, 11])
    ids = alg.token_turn_ids(turn_end, cu, torch.tensor([0, 2, 2, 3, 3]))
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, -1, -1, 2, 2, 2]


def gigpo_batch():
    """Group 0: three trajectories from state 7, one of which (traj 1) stays on 7 for a second turn; group 1: one
    trajectory. Turn rewards: traj 0 [1, 2] (states 7, 9), traj 1 [0, 1] (7, 7), traj 2 [2] (7), traj 3 [5] (7)."""
    b = packed([5, 3, 2, 2], [0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1], scores=[3, 1, 2, 5], group_ids=[0, 0, 0, 1],
               turn_end=[0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1])
    b.turn_keys = torch.tensor([7, 9, 7, 7, 7, 7])
    b.turn_rewards = torch.tensor([1.0, 2.0, 0.0, 1.0, 2.0, 5.0])
    b.cu_turns = torch.tensor([0, 2, 4, 5, 6])
    b.turn_ids = alg.token_turn_ids(b.turn_end, b.cu_seqlens, b.cu_turns)
    return b


def test_gigpo_by_hand_through_the_registry():
    # gamma 0.5: G = [2, 2], [0.5, 1], [2], [5]; episode (mean mode): group 0 mean 2 -> [1, -1, 0], group 1 -> 0;
    # step group (0, 7) = {2, 0.5, 1, 2} (mean 1.375), (0, 9) and (1, 7) are singletons (0); w = 2
    b = gigpo_batch()
    cfg = AlgorithmConfig(adv_estimator="gigpo", gigpo_norm="mean", gigpo_step_gamma=0.5, gigpo_step_weight=2.0)
    adv, ret = alg.compute_advantages(b, cfg)
    t = [1 + 2 * 0.625, 1.0, -1 + 2 * -0.875, -1 + 2 * -0.375, 2 * 0.625, 0.0]  # per turn
    assert adv.tolist() == [0, t[0], t[0], t[1], t[1]] + [0, t[2], t[3]] + [t[4], t[4]] + [0, t[5]]
    assert ret is None
    assert b.metrics == {"adv/gigpo_nonsingleton_turn_fraction": 4 / 6, "adv/gigpo_step_group_size": 18 / 6,
                         "adv/gigpo_nonsingleton_later_turn_fraction": 1 / 2,
                         "adv/gigpo_step_abs_mean": (0.625 + 0.875 + 0.375 + 0.625) / 6}


def test_gigpo_needs_turn_data_and_a_valid_config():
    with pytest.raises(ValueError, match="gigpo.*missing.*turn_keys"):
        alg.compute_advantages(packed([2], [1, 1]), AlgorithmConfig(adv_estimator="gigpo"))
    with pytest.raises(ValueError, match="step_gamma must lie in"):
        alg.compute_advantages(gigpo_batch(), AlgorithmConfig(adv_estimator="gigpo", gigpo_step_gamma=-0.1))
    assert not alg.needs_critic(AlgorithmConfig(adv_estimator="gigpo"))


def test_turn_data_keeps_the_sequence_turns():
    from fastpo.rollout import turn_data

    keys, rewards = turn_data([0, 1, 0, 1], [5, -1, 6], [1.0, -0.1, 0.5], [0.0, -0.1, 0.0])
    assert keys.dtype == np.int64 and keys.tolist() == [-1, 6]  # the last 2 of 3 turns (a context window)
    assert rewards.dtype == np.float32 and rewards.tolist() == pytest.approx([-0.2, 0.5])
    assert turn_data([0, 0], [], [], [])[0].shape == (0,)
    with pytest.raises(ValueError, match="do not cover"):
        turn_data([1, 1], [3], [0.0], [0.0])


def test_filter_target_over_refill_rounds():
    """Dynamic sampling: with ``target`` the std filter keeps exactly that many groups of the pooled rounds (the
    largest std), the nonzero filter at most that many (the lowest group ids with a spread)."""
    scores = torch.tensor([0, 0, 1, 0, 3, 0, 1, 1, 0, 2, 5, 5], dtype=torch.float32)  # 6 groups of 2
    ids = torch.arange(12) // 2
    keep, _ = alg.filter_groups(scores, ids, 0.25, "std", target=2)
    assert ids[keep].unique().tolist() == [2, 4]  # std 2.12 and 1.41: the two largest
    keep, _ = alg.filter_groups(scores, ids, 1.0, "nonzero", target=2)
    assert ids[keep].unique().tolist() == [1, 2]  # groups 1, 2, 4 have a spread: the first two
    keep, _ = alg.filter_groups(scores, ids, 1.0, "nonzero", target=9)
    assert ids[keep].unique().tolist() == [1, 2, 4]  # fewer than the target: all of them
    with pytest.raises(ValueError, match="target must be >= 1"):
        alg.filter_groups(scores, ids, 1.0, "std", target=0)


# ------------------------------------------------------------------------------ RAGEN-2 advantage options
def _grpo_case():
    """Two groups: G0 returns [1, 3] (mean 2, std sqrt 2), G1 [0, 0] (std 0); trained tokens 2, 1, 3, 2 of
    lengths 3, 2, 4, 2 (the first token of each trajectory is a prompt token)."""
    lengths = [3, 2, 4, 2]
    mask = [0, 1, 1] + [0, 1] + [0, 1, 1, 1] + [0, 1]
    return packed(lengths, mask, scores=[1.0, 3.0, 0.0, 0.0], group_ids=[5, 5, 9, 9])


def per_token(batch, per_seq):
    """The expected [N] tensor: per_seq[i] on trajectory i's trained tokens."""
    out = []
    for i, (a, b) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist(), strict=True)):
        out += [per_seq[i] if batch.loss_mask[t] else 0.0 for t in range(a, b)]
    return torch.tensor(out, dtype=torch.float32)


def test_soft_advantage_reweight_by_hand():
    batch = _grpo_case()
    cfg = AlgorithmConfig(adv_estimator="grpo", soft_advantage_reweight=True)
    adv, _ = alg.compute_advantages(batch, cfg)
    z = 1 / (math.sqrt(2) + 1e-6)  # grpo: (1 - 2) / (sqrt 2 + eps) and (3 - 2) / (...); G1 all 0
    w0 = math.sqrt(2) / (math.sqrt(2) + 1e-6)  # G0's std / (the largest std + eps); G1 weighs 0
    torch.testing.assert_close(adv, per_token(batch, [-z * w0, z * w0, 0.0, 0.0]))
    assert batch.metrics["adv/soft_reweight_mean"] == pytest.approx(w0 / 2)
    # a group of one counts as std 1 (RAGEN's GRPO convention): weights 1/(2 + eps) and 2/(2 + eps)
    w = alg.soft_reweight(torch.tensor([0.0, 4.0, 2.0, 7.0]), torch.tensor([0, 0, 1, 2]))
    s = math.sqrt(8)  # [0, 4]: unbiased std sqrt(8)
    torch.testing.assert_close(w, torch.tensor([s / (s + 1e-6)] * 2 + [1 / (s + 1e-6)] * 2))
    # grpo_norm none: every row its own group of one -> all weights 1 / (1 + eps)
    batch = _grpo_case()
    adv, _ = alg.compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", grpo_norm="none",
                                                           soft_advantage_reweight=True))
    r = 1 / (1 + 1e-6)
    torch.testing.assert_close(adv, per_token(batch, [1.0 * r * r, 3.0 * r * r, 0.0, 0.0]))


def test_grpo_length_weight_by_hand():
    batch = _grpo_case()
    adv, _ = alg.compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", grpo_length_weight=True))
    z = 1 / (math.sqrt(2) + 1e-6)
    mean = (2 + 1 + 3 + 1) / 4  # trained tokens per trajectory
    torch.testing.assert_close(adv, per_token(batch, [-z * mean / (2 + 1e-6), z * mean / (1 + 1e-6), 0.0, 0.0]))
    torch.testing.assert_close(alg.length_weight(batch.loss_mask, batch.cu_seqlens),
                               torch.tensor([mean / 2, mean / 1, mean / 3, mean / 1]), rtol=1e-5, atol=0)


def test_zero_task_advantage_keeps_returns():
    lengths, mask = [3], [1, 1, 1]
    batch = packed(lengths, mask, rewards=[0.0, 0.0, 1.0], values=[0.1, 0.2, 0.3])
    cfg = AlgorithmConfig(adv_estimator="gae", zero_task_advantage=True)
    adv, ret = alg.compute_advantages(batch, cfg)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(ret, torch.tensor([1.0, 1.0, 1.0]))  # gamma = lam = 1: R on every token
    adv, _ = alg.compute_advantages(_grpo_case(), AlgorithmConfig(adv_estimator="grpo", zero_task_advantage=True,
                                                                  soft_advantage_reweight=True))
    assert not adv.any()


def test_norm_adv_by_std_switch():
    batch = _grpo_case()
    adv, _ = alg.compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=False))
    torch.testing.assert_close(adv, per_token(batch, [-1.0, 1.0, 0.0, 0.0]))  # R - group mean only


def test_options_off_leave_the_estimator_alone():
    for est in ("grpo", "rloo"):
        a, _ = alg.compute_advantages(_grpo_case(), AlgorithmConfig(adv_estimator=est))
        b, _ = alg.ADV_ESTIMATORS[est](_grpo_case(), AlgorithmConfig(adv_estimator=est))
        assert torch.equal(a, b)


@pytest.mark.parametrize("changes,pieces", [
    ({"soft_advantage_reweight": True}, ["algorithm.soft_advantage_reweight=true", "'grpo' only", "'gae'"]),
    ({"grpo_length_weight": True, "adv_estimator": "rloo"}, ["algorithm.grpo_length_weight=true", "'rloo'"]),
    ({"zero_task_advantage": "yes"}, ["algorithm.zero_task_advantage", "expected bool, got 'yes'"]),
])
def test_advantage_option_config_errors(changes, pieces):
    from fastpo.config import Config, ConfigError
    from fastpo.preflight import validate

    cfg = Config()
    for key, value in changes.items():
        setattr(cfg.algorithm, key, value)
    if cfg.algorithm.adv_estimator != "gae":
        cfg.optim.critic_lr = 1e-5
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    for piece in pieces:
        assert piece in str(err.value)
