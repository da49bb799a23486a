"""RAGEN's estimator variants as named options (algorithm.grpo_norm, gae_skip_observations, bilevel_turns), each
against a formula or loop written here."""

import math

import pytest
import torch

from fastpo import algorithms as alg
from fastpo import kernels
from fastpo.config import AlgorithmConfig, Config, ConfigError
from fastpo.preflight import validate


def batch(lengths, mask, rewards=None, values=None, turn_end=None, scores=None, group_ids=None):
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return alg.PackedBatch(
        token_rewards=torch.tensor(rewards if rewards is not None else [0.0] * n, dtype=torch.float32),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        turn_end=torch.tensor(turn_end if turn_end is not None else [False] * n, dtype=torch.bool),
        cu_seqlens=cu,
        scores=torch.tensor(scores if scores is not None else [0.0] * len(lengths), dtype=torch.float32),
        group_ids=torch.tensor(group_ids if group_ids is not None else list(range(len(lengths))), dtype=torch.int64),
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


def whiten_on(x, mask):
    """verl masked_whiten: (x - mean) / sqrt(unbiased var + 1e-8) over the masked entries (0 elsewhere here)."""
    x, m = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(mask, dtype=torch.bool)
    sel = x[m]
    out = torch.zeros_like(x)
    out[m] = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)
    return out.float()


# ------------------------------------------------------------------------------------------------ grpo_norm
SCORES = [1.0, 0.0, 3.0, 2.0, 2.0, 4.0]
GIDS = [7, 7, 7, 3, 3, 3]
LENGTHS = [3, 2, 4, 2, 3, 2]


def grpo_batch():
    mask = [t % 2 == 1 or ln == 2 for ln in LENGTHS for t in range(ln)]
    return batch(LENGTHS, mask, scores=SCORES, group_ids=GIDS), mask


def per_token(per_seq, mask):
    seq = [i for i, ln in enumerate(LENGTHS) for _ in range(ln)]
    return torch.tensor([per_seq[s] if m else 0.0 for s, m in zip(seq, mask, strict=True)])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_norm_group_batch_none(norm_by_std):
    b, mask = grpo_batch()
    groups = {g: [s for s, h in zip(SCORES, GIDS, strict=True) if h == g] for g in set(GIDS)}

    def mean(x):
        return sum(x) / len(x)

    def std(x):  # unbiased
        return math.sqrt(sum((v - mean(x)) ** 2 for v in x) / (len(x) - 1))

    expected = {
        "group": [(s - mean(groups[g])) / ((std(groups[g]) + 1e-6) if norm_by_std else 1.0)
                  for s, g in zip(SCORES, GIDS, strict=True)],
        "batch": [(s - mean(SCORES)) / ((std(SCORES) + 1e-6) if norm_by_std else 1.0) for s in SCORES],
        # verl's GRPO on groups of one (RAGEN's uid per trajectory): mean 0, std 1
        "none": [s / ((1.0 + 1e-6) if norm_by_std else 1.0) for s in SCORES],
    }
    for mode, per_seq in expected.items():
        adv, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="grpo", grpo_norm=mode,
                                                             norm_adv_by_std=norm_by_std))
        assert ret is None
        torch.testing.assert_close(adv, per_token(per_seq, mask), rtol=1e-5, atol=1e-6, msg=mode)
    # the three differ on this batch (a mode silently falling back to another would pass nothing above)
    assert expected["group"] != expected["batch"] != expected["none"]


def test_grpo_norm_none_and_batch_accept_groups_of_one():
    cfg = Config()
    cfg.algorithm.adv_estimator, cfg.env.group_size, cfg.optim.mini_batch_size = "grpo", 1, 2
    cfg.algorithm.rollout_filter_ratio = 1.0
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        validate(cfg)
    for mode in ("batch", "none"):
        cfg.algorithm.grpo_norm = mode
        validate(cfg)
    cfg.algorithm.grpo_norm = "mean"
    with pytest.raises(ConfigError, match="algorithm.grpo_norm"):
        validate(cfg)


# --------------------------------------------------------------------------------------- verl-equal GAE
def verl_gae_loop(rewards, values, mask, lengths, gamma, lam):
    """verl@1e47e41 compute_gae_advantage_return on each sequence's response (from its first trained token on),
    written as its loop: every position, observation tokens included; then masked whitening."""
    adv, ret, start = [0.0] * len(rewards), [0.0] * len(rewards), 0
    for ln in lengths:
        pos = list(range(start, start + ln))
        first = next(p for p in pos if mask[p])
        resp = [p for p in pos if p >= first]
        r = {p: rewards[p] for p in resp}
        r[first] += sum(rewards[p] for p in pos if p < first)
        last = 0.0
        for i in reversed(range(len(resp))):
            p = resp[i]
            nxt = values[resp[i + 1]] if i + 1 < len(resp) else 0.0
            last = r[p] + gamma * nxt - values[p] + gamma * lam * last
            adv[p], ret[p] = last, last + values[p]
        start += ln
    ret = [x if m else 0.0 for x, m in zip(ret, mask, strict=True)]
    return whiten_on(adv, mask), torch.tensor(ret)


# two sequences: prompt, turn 1, observation, turn 2 (+ a trailing observation), a reward on an observation token
GAE_LENGTHS = [9, 7]
GAE_MASK = [0, 0, 1, 1, 0, 0, 1, 1, 0] + [0, 1, 1, 1, 0, 1, 1]
GAE_REWARDS = [0.0] * 5 + [0.5] + [0.0, 1.0, 0.0] + [0.3] + [0.0] * 5 + [-1.0]
GAE_VALUES = [0.9, -0.4, 0.2, 0.4, 0.7, -0.3, 0.1, 0.6, 0.8, 0.25, 0.5, -0.2, 0.3, 1.1, 0.05, 0.4]


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 0.7), (0.95, 1.0), (0.5, 0.0)])
def test_gae_verl_equal_for_any_gamma_lam(gamma, lam):
    b = batch(GAE_LENGTHS, GAE_MASK, rewards=GAE_REWARDS, values=GAE_VALUES)
    cfg = AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam, gae_skip_observations=False)
    adv, ret = alg.compute_advantages(b, cfg)
    want_adv, want_ret = verl_gae_loop(GAE_REWARDS, GAE_VALUES, GAE_MASK, GAE_LENGTHS, gamma, lam)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, want_ret, rtol=1e-5, atol=1e-5)
    # fastpo's multi-turn rule differs once gamma * lam or gamma decays across the observation tokens
    skip, _ = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="gae", gamma=gamma, lam=lam))
    assert not torch.allclose(skip, adv, atol=1e-4)


def test_gae_verl_equals_fastpo_at_gamma_lam_one():
    b = batch(GAE_LENGTHS, GAE_MASK, rewards=GAE_REWARDS, values=GAE_VALUES)
    verl, verl_ret = alg.compute_advantages(b, AlgorithmConfig(gae_skip_observations=False))
    skip, skip_ret = alg.compute_advantages(b, AlgorithmConfig())
    torch.testing.assert_close(verl, skip, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(verl_ret, skip_ret, rtol=1e-5, atol=1e-6)
    # padded [B, T] input gives the same as packed
    r, v, m = kernels.reference.padded_view([b.token_rewards, b.values, b.loss_mask], b.cu_seqlens)
    pa, _ = kernels.gae_advantages(r, v, m, 0.9, 0.8, skip_observations=False)
    pk, _ = kernels.gae_advantages(b.token_rewards, b.values, b.loss_mask, 0.9, 0.8, cu_seqlens=b.cu_seqlens,
                                   skip_observations=False)
    torch.testing.assert_close(kernels.reference.padded_to_packed(pa, b.cu_seqlens, len(GAE_MASK)), pk)


def test_response_span():
    mask = torch.tensor([0, 0, 1, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    span = kernels.reference.response_span(mask, torch.tensor([0, 5, 9]))
    assert span.tolist() == [False, False, True, True, True, False, False, True, True]
    assert kernels.reference.response_span(mask.view(1, 9)).tolist() == [[False] * 2 + [True] * 7]


def test_gae_skip_observations_false_only_for_gae():
    cfg = Config()
    cfg.algorithm.gae_skip_observations = False
    validate(cfg)  # gae (default)
    cfg.algorithm.adv_estimator = "bilevel_gae"
    with pytest.raises(ConfigError, match="gae_skip_observations=false applies to adv_estimator 'gae' only"):
        validate(cfg)


# -------------------------------------------------------------------------------------- bi-level turns
def ragen_bilevel_loop(rewards, values, mask, gamma, lam, gamma_high):
    """RAGEN's bi-level GAE for one row (ragen/trainer/core_algos.py), as its two loops: turns = the positions of
    non-zero rewards; high level over them with gamma_high, low level over trained positions with the turn return
    on each turn end. Not whitened."""
    n = len(rewards)
    ends = [p for p in range(n) if rewards[p] != 0]
    adv, upd = [0.0] * n, list(rewards)
    last = 0.0
    for i in reversed(range(len(ends))):
        nxt = values[ends[i + 1]] if i + 1 < len(ends) else 0.0
        last = upd[ends[i]] + gamma_high * nxt - values[ends[i]] + gamma_high * lam * last
        adv[ends[i]] = last
    for p in ends:
        upd[p] = adv[p] + values[p]
    valid = [p for p in range(n) if mask[p]]
    last = 0.0
    for i in reversed(range(len(valid))):
        p = valid[i]
        if p in ends:
            nxt, last = 0.0, 0.0
        else:
            nxt = values[valid[i + 1]]
        last = upd[p] + gamma * nxt - values[p] + gamma * lam * last
        adv[p] = last
    return adv


# one row, three turns (trained runs separated by observations); rewards on two trained turn ends
BL_MASK = [0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1]
BL_TURN_END = [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
BL_VALUES = [0.0, 0.2, 0.4, 0.0, 0.0, -0.1, 0.3, 0.0, 0.5, 0.6, 0.7]


@pytest.mark.parametrize("rewards", [
    [0.0] * 10 + [1.0],                                    # trajectory-level reward only (RAGEN's bi-level setting)
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 1.0],  # a second reward ends an earlier "turn"
])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95)])
def test_bilevel_turns_reward_is_ragen(rewards, gamma, lam):
    b = batch([11], BL_MASK, rewards=rewards, values=BL_VALUES, turn_end=BL_TURN_END)
    cfg = AlgorithmConfig(adv_estimator="bilevel_gae", gamma=gamma, lam=lam, gamma_high=0.95, bilevel_turns="reward")
    adv, _ = alg.compute_advantages(b, cfg)
    want = ragen_bilevel_loop(rewards, BL_VALUES, BL_MASK, gamma, lam, 0.95)
    torch.testing.assert_close(adv, whiten_on(want, BL_MASK), rtol=1e-5, atol=1e-5)


def test_bilevel_turns_reward_drops_the_turn_discount():
    """One end-of-episode reward R = 1, gamma = lam = 1: RAGEN's rule gives A_t = R - V_t on every trained token;
    fastpo's explicit turns discount R by gamma_high per later turn (tokens of turn k from the end see 0.95^k R
    as their turn's return, before the value terms)."""
    rewards = [0.0] * 10 + [1.0]
    b = batch([11], BL_MASK, rewards=rewards, values=BL_VALUES, turn_end=BL_TURN_END)
    ragen, ret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="bilevel_gae", bilevel_turns="reward"))
    raw = [(1.0 - v) if m else 0.0 for v, m in zip(BL_VALUES, BL_MASK, strict=True)]
    torch.testing.assert_close(ragen, whiten_on(raw, BL_MASK), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, torch.tensor([float(m) for m in BL_MASK]), rtol=1e-6, atol=1e-6)
    fastpo, fret = alg.compute_advantages(b, AlgorithmConfig(adv_estimator="bilevel_gae"))
    # turn-level GAE (lam 1): G_last = 1, G_mid = 0.95 * V(end_last)... returns on the first turn's tokens < 1
    v_end = {2: 0.4, 6: 0.3, 10: 0.7}
    g3 = 1.0
    g2 = 0.0 + 0.95 * v_end[10] - v_end[6] + 0.95 * (g3 - v_end[10]) + v_end[6]
    g1 = 0.0 + 0.95 * v_end[6] - v_end[2] + 0.95 * (g2 - v_end[6]) + v_end[2]
    assert g2 == pytest.approx(0.95) and g1 == pytest.approx(0.95**2)
    want_ret = [0.0, g1, g1, 0, 0, g2, g2, 0, g3, g3, g3]
    torch.testing.assert_close(fret, torch.tensor(want_ret), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fastpo, ragen, atol=1e-3)


@pytest.mark.slow
def test_trainer_feeds_verl_gae_the_observation_values(tmp_path, monkeypatch):
    """algorithm.gae_skip_observations=false: the trainer scores critic values on observation tokens too (verl's
    recursion reads them), and the update's advantages are verl's loop over those values."""
    from test_trainer import SMALL

    from fastpo.config_load import parse_args
    from fastpo.trainer import Trainer

    seen = []
    real = alg.compute_advantages

    def spy(b, cfg):
        out = real(b, cfg)
        seen.append((b, out))
        return out

    monkeypatch.setattr(alg, "compute_advantages", spy)
    cfg = validate(parse_args([*SMALL, "--trainer.run_dir", str(tmp_path / "run"), "--trainer.iterations", "1",
                               "--trainer.val_before_train", "false", "--algorithm.adv_estimator", "gae",
                               "--algorithm.gae_skip_observations", "false", "--algorithm.gamma", "0.9",
                               "--algorithm.lam", "0.8", "--algorithm.rollout_filter_ratio", "1"]), 1)
    trainer = Trainer(cfg)
    trainer.step = 1
    metrics = trainer.iteration()
    trainer.close(export=False)
    (b, (adv, ret)), = seen
    span = kernels.reference.response_span(b.loss_mask, b.cu_seqlens)
    observation = span & ~b.loss_mask
    assert observation.any() and (b.values[observation] != 0).any()  # values read beyond the trained tokens
    assert (b.values[~span] == 0).all()
    lengths = b.cu_seqlens.diff().tolist()
    want_adv, want_ret = verl_gae_loop(b.token_rewards.tolist(), b.values.tolist(), b.loss_mask.tolist(), lengths,
                                       0.9, 0.8)
    torch.testing.assert_close(adv, want_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret, want_ret, rtol=1e-4, atol=1e-4)
    assert math.isfinite(metrics["critic/vf_loss"]) and math.isfinite(metrics["critic/vf_explained_var"])
