"""GAE, bi-level GAE and GRPO against per-position Python loops / a dict walk (tests/kernels/_truth.py), plus
hand-checked cases: gamma = lambda = 1 gives R - V, observation tokens are skipped, rewards on observation
tokens are not lost, constant and singleton groups give 0, padded and packed layouts agree."""

import pytest
import torch
from _truth import bilevel_gae_loop, gae_loop, grpo_dict, whiten_truth

import fastpo.kernels as K

PARAMS = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)]


def _multi_turn(b, t, device, p_trained=0.4, dtype=torch.float32):
    """Rows of alternating observation / response blocks (a prompt first), a reward on some tokens."""
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row in range(b):
        pos = int(torch.randint(1, 6, ()).item())
        while pos < t:
            resp = int(torch.randint(1, 9, ()).item())
            mask[row, pos : pos + resp] = True
            pos += resp + int(torch.randint(1, max(2, int(resp * (1 - p_trained) / p_trained) + 1), ()).item())
    rewards = torch.where(torch.rand(b, t) < 0.2, torch.randn(b, t), torch.zeros(b, t))
    values = torch.randn(b, t)
    return rewards.to(device, dtype), values.to(device, dtype), mask.to(device)


@pytest.mark.parametrize("gamma,lam", PARAMS)
@pytest.mark.parametrize("length", [1, 7, 513])
def test_gae_matches_loop(backend, device, gamma, lam, length):
    rewards, values, mask = _multi_turn(3, length, device)
    if length > 1:
        mask[1] = False  # a row with nothing trained
    adv, ret = K.gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    t_adv, t_ret = gae_loop(rewards.cpu(), values.cpu(), mask.cpu(), gamma, lam)
    assert adv.dtype == torch.float32 and adv.shape == mask.shape
    torch.testing.assert_close(adv.cpu().double(), t_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), t_ret, atol=2e-5, rtol=1e-5)
    white, ret2 = K.gae_advantages(rewards, values, mask, gamma, lam, whiten=True)
    torch.testing.assert_close(white.cpu().double(), whiten_truth(t_adv, mask.cpu()), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret2, ret)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_gae_input_dtypes(backend, device, dtype):
    rewards, values, mask = _multi_turn(2, 40, device, dtype=dtype)
    adv, ret = K.gae_advantages(rewards, values, mask, 0.97, 0.9, whiten=False)
    t_adv, t_ret = gae_loop(rewards.cpu().double(), values.cpu().double(), mask.cpu(), 0.97, 0.9)
    torch.testing.assert_close(adv.cpu().double(), t_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), t_ret, atol=2e-5, rtol=1e-5)


def test_gae_gamma_lambda_one_is_return_minus_value(backend, device):
    """Hand-checked: positions 0-1 prompt, 2-3 response, 4 observation, 5-6 response; reward 1 at 6 and 0.5 on the
    observation token 4 (credited to token 3, the action before it)."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]], dtype=torch.bool, device=device)
    rewards = torch.tensor([[0, 0, 0, 0, 0.5, 0, 1.0]], device=device)
    values = torch.tensor([[9.0, 9.0, 0.1, 0.2, 9.0, 0.3, 0.4]], device=device)
    adv, ret = K.gae_advantages(rewards, values, mask, 1.0, 1.0, whiten=False)
    want = torch.tensor([[0, 0, 1.5 - 0.1, 1.5 - 0.2, 0, 1.0 - 0.3, 1.0 - 0.4]], device=device)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, torch.where(mask, torch.tensor([[0, 0, 1.5, 1.5, 0, 1.0, 1.0]], device=device),
                                                torch.zeros_like(ret)))


def test_gae_reward_before_first_trained_token_is_kept(backend, device):
    mask = torch.tensor([[0, 0, 1, 1]], dtype=torch.bool, device=device)
    rewards = torch.tensor([[2.0, 0, 0, 1.0]], device=device)
    adv, _ = K.gae_advantages(rewards, torch.zeros(1, 4, device=device), mask, 0.5, 1.0, whiten=False)
    # token 2 gets 2.0 + gamma * (its successor's return 1.0); token 3 gets 1.0
    torch.testing.assert_close(adv, torch.tensor([[0, 0, 2.5, 1.0]], device=device))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9)])
def test_gae_ignores_values_on_observation_tokens(backend, device, gamma, lam):
    rewards, values, mask = _multi_turn(4, 60, device)
    adv, ret = K.gae_advantages(rewards, values, mask, gamma, lam)
    noisy = torch.where(mask, values, values + 100 * torch.randn_like(values))
    noisy[~mask & (torch.rand_like(values) < 0.1)] = float("nan")
    adv2, ret2 = K.gae_advantages(rewards, noisy, mask, gamma, lam)
    assert (noisy != values).any()
    torch.testing.assert_close(adv2, adv, atol=0, rtol=0)
    torch.testing.assert_close(ret2, ret, atol=0, rtol=0)


def test_gae_fully_masked_is_zero(backend, device):
    rewards, values, mask = _multi_turn(2, 9, device)
    adv, ret = K.gae_advantages(rewards, values, torch.zeros_like(mask), 0.9, 0.9)
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.equal(ret, torch.zeros_like(ret))


def _pack(mask_lens, *tensors):
    t_max = tensors[0].shape[1]
    lens = torch.tensor(mask_lens)
    valid = (torch.arange(t_max)[None, :] < lens[:, None]).to(tensors[0].device)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(tensors[0].device)
    return cu, valid, [x[valid] for x in tensors]


def test_gae_packed_matches_padded(backend, device):
    rewards, values, mask = _multi_turn(4, 50, device)
    lens = [50, 0, 17, 33]
    for b, n in enumerate(lens):
        mask[b, n:] = False
        rewards[b, n:] = 0
    cu, valid, (r, v, m) = _pack(lens, rewards, values, mask)
    adv, ret = K.gae_advantages(rewards, values, mask, 0.9, 0.95)
    adv_p, ret_p = K.gae_advantages(r, v, m, 0.9, 0.95, cu_seqlens=cu)
    torch.testing.assert_close(adv_p, adv[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_p, ret[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma,lam,gamma_high,lam_high", [(1.0, 1.0, 0.95, None), (0.9, 0.8, 0.7, 0.9)])
@pytest.mark.parametrize("length", [7, 200])
def test_bilevel_gae_matches_loop(backend, device, gamma, lam, gamma_high, lam_high, length):
    rewards, values, mask = _multi_turn(3, length, device)
    turn_end = (torch.rand(3, length, device=device) < 0.1) & ~mask  # some flags sit on observation tokens
    turn_end |= mask & (torch.rand(3, length, device=device) < 0.05)
    adv, ret = K.bilevel_gae_advantages(rewards, values, mask, turn_end, gamma, lam, gamma_high, lam_high,
                                        whiten=False)
    t_adv, t_ret = bilevel_gae_loop(rewards.cpu(), values.cpu(), mask.cpu(), turn_end.cpu(), gamma, lam, gamma_high,
                                    lam if lam_high is None else lam_high)
    torch.testing.assert_close(adv.cpu().double(), t_adv, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), t_ret, atol=2e-5, rtol=1e-5)
    white, _ = K.bilevel_gae_advantages(rewards, values, mask, turn_end, gamma, lam, gamma_high, lam_high)
    torch.testing.assert_close(white.cpu().double(), whiten_truth(t_adv, mask.cpu()), atol=1e-4, rtol=1e-4)


def test_bilevel_turns_come_from_turn_end_not_rewards(backend, device):
    """Two turns [1, 2] and [4, 5]; a zero-reward turn is still a turn and a reward inside a turn ends nothing.
    Values 0, gamma = lam = 1, gamma_high = 0.5: turn returns are G2 = 1 and G1 = 0.25 + 0.5 * G2 = 0.75, and every
    token of a turn gets its turn's return."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]], dtype=torch.bool, device=device)
    turn_end = torch.tensor([[0, 0, 1, 0, 0, 0]], dtype=torch.bool, device=device)
    rewards = torch.tensor([[0, 0.25, 0, 0, 0, 1.0]], device=device)
    adv, _ = K.bilevel_gae_advantages(rewards, torch.zeros(1, 6, device=device), mask, turn_end, 1.0, 1.0, 0.5,
                                      whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.75, 0.75, 0, 1.0, 1.0]], device=device))


def test_bilevel_packed_matches_padded(backend, device):
    rewards, values, mask = _multi_turn(3, 30, device)
    turn_end = torch.rand(3, 30, device=device) < 0.15
    lens = [30, 12, 21]
    for b, n in enumerate(lens):
        mask[b, n:] = False
        rewards[b, n:] = 0
    cu, valid, (r, v, m, te) = _pack(lens, rewards, values, mask, turn_end)
    adv, ret = K.bilevel_gae_advantages(rewards, values, mask, turn_end, 0.9, 0.9, 0.8)
    adv_p, ret_p = K.bilevel_gae_advantages(r, v, m, te, 0.9, 0.9, 0.8, cu_seqlens=cu)
    torch.testing.assert_close(adv_p, adv[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_p, ret[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_matches_dict(backend, device, norm_by_std, dtype):
    scores = torch.randn(19, device=device).to(dtype)
    group_ids = torch.tensor([5, 5, 5, 9, 9, 1, 7, 7, 7, 7, 5, 3, 3, 3, 42, -4, -4, 9, 1], device=device)
    mask = torch.rand(19, 6, device=device) < 0.6
    adv = K.grpo_advantages(scores, group_ids, mask, norm_by_std=norm_by_std)
    want = grpo_dict(scores.cpu().double(), group_ids.cpu(), norm_by_std)
    torch.testing.assert_close(adv.cpu().double(), want[:, None] * mask.cpu(), atol=1e-5, rtol=1e-5)


def test_grpo_constant_and_singleton_groups_are_zero(backend, device):
    scores = torch.tensor([0.3, 0.3, 0.3, 1.0, 2.0, 5.0], device=device)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2], device=device)
    adv = K.grpo_advantages(scores, group_ids, torch.ones(6, 3, dtype=torch.bool, device=device))
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv[[0, 1, 2, 5]], torch.zeros(4, 3, device=device))
    std = torch.tensor([1.0, 2.0]).std().item()
    torch.testing.assert_close(adv[3, 0].item(), -0.5 / (std + 1e-6), atol=1e-5, rtol=1e-5)


def test_grpo_packed_matches_padded(backend, device):
    scores = torch.randn(4, device=device)
    group_ids = torch.tensor([0, 0, 1, 1], device=device)
    mask = torch.rand(4, 10, device=device) < 0.7
    lens = [10, 3, 0, 7]
    for b, n in enumerate(lens):
        mask[b, n:] = False
    cu, valid, (m,) = _pack(lens, mask)
    adv = K.grpo_advantages(scores, group_ids, mask)
    adv_p = K.grpo_advantages(scores, group_ids, m, cu_seqlens=cu)
    torch.testing.assert_close(adv_p, adv[valid])
