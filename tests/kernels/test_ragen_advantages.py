"""The RAGEN / verl variants of the GAE kernels on both backends: verl's per-position GAE
(skip_observations=False) and bi-level turns from non-zero rewards (turns="reward"), against loops written here."""

import pytest
import torch
from _truth import bilevel_gae_loop, whiten_truth
from test_advantages import _multi_turn, _pack

import fastpo.kernels as K


def verl_gae_truth(rewards, values, mask, gamma, lam):
    """verl@1e47e41 compute_gae_advantage_return per row over its response (first trained token to the row end),
    every position walked; rewards before the response go to its first token. Un-whitened, fp64."""
    rows, length = mask.shape
    adv = torch.zeros(rows, length, dtype=torch.float64)
    ret = torch.zeros(rows, length, dtype=torch.float64)
    for b in range(rows):
        trained = [t for t in range(length) if mask[b, t]]
        if not trained:
            continue
        first = trained[0]
        r = [float(x) for x in rewards[b]]
        r[first] += sum(r[:first])
        last = 0.0
        for t in reversed(range(first, length)):
            nxt = float(values[b, t + 1]) if t + 1 < length else 0.0
            last = r[t] + gamma * nxt - float(values[b, t]) + gamma * lam * last
            if mask[b, t]:
                adv[b, t], ret[b, t] = last, last + float(values[b, t])
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_verl_gae_matches_loop(backend, device, gamma, lam):
    rewards, values, mask = _multi_turn(3, 90, device)
    adv, ret = K.gae_advantages(rewards, values, mask, gamma, lam, skip_observations=False)
    t_adv, t_ret = verl_gae_truth(rewards.cpu(), values.cpu(), mask.cpu(), gamma, lam)
    torch.testing.assert_close(ret.cpu().double(), t_ret, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(adv.cpu().double(), whiten_truth(t_adv, mask.cpu()), atol=1e-4, rtol=1e-4)


def test_verl_gae_packed_matches_padded(backend, device):
    rewards, values, mask = _multi_turn(4, 50, device)
    lens = [50, 0, 17, 33]
    for b, n in enumerate(lens):
        mask[b, n:] = False
        rewards[b, n:] = 0
    cu, valid, (r, v, m) = _pack(lens, rewards, values, mask)
    # the padded rows end at the sequence ends here (values after them would be read by the padded recursion)
    values = torch.where(valid, values, 0.0)
    adv, ret = K.gae_advantages(rewards, values, mask, 0.9, 0.95, skip_observations=False)
    adv_p, ret_p = K.gae_advantages(r, v, m, 0.9, 0.95, cu_seqlens=cu, skip_observations=False)
    torch.testing.assert_close(adv_p, adv[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_p, ret[valid], atol=1e-5, rtol=1e-5)


def reward_ends_truth(rewards, mask):
    """Trained positions holding a non-zero reward after crediting (last trained position at or before it)."""
    rows, length = mask.shape
    ends = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        trained = [t for t in range(length) if mask[b, t]]
        credit = dict.fromkeys(trained, 0.0)
        for t in range(length):
            if trained:
                owner = max([p for p in trained if p <= t], default=trained[0])
                credit[owner] += float(rewards[b, t])
        for p, c in credit.items():
            ends[b, p] = c != 0
    return ends


@pytest.mark.parametrize("gamma,lam,gamma_high", [(1.0, 1.0, 0.95), (0.9, 0.8, 0.7)])
def test_bilevel_reward_turns_match_loop(backend, device, gamma, lam, gamma_high):
    rewards, values, mask = _multi_turn(3, 80, device)
    ignored = torch.rand(3, 80, device=device) < 0.3  # turn_end is not read with turns="reward"
    adv, ret = K.bilevel_gae_advantages(rewards, values, mask, ignored, gamma, lam, gamma_high, whiten=False,
                                        turns="reward")
    ends = reward_ends_truth(rewards.cpu(), mask.cpu())
    assert ends.any()
    t_adv, t_ret = bilevel_gae_loop(rewards.cpu(), values.cpu(), mask.cpu(), ends, gamma, lam, gamma_high, lam)
    torch.testing.assert_close(adv.cpu().double(), t_adv, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), t_ret, atol=5e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="turns must be one of"):
        K.bilevel_gae_advantages(rewards, values, mask, ignored, turns="nonzero")


def test_verl_gae_compiles_fullgraph(device):
    torch._dynamo.reset()
    rewards, values, mask = _multi_turn(3, 20, device)

    def f(r, v, m):
        return K.gae_advantages(r, v, m, 0.9, 0.8, skip_observations=False)

    for got, want in zip(torch.compile(f, fullgraph=True)(rewards, values, mask), f(rewards, values, mask),
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
