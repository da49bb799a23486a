"""Off-policy correction: the ``is_weight`` argument of ppo_loss (Triton in the interpreter and torch) and the
weights function ``offpolicy_weights``, each against formulas written out token by token in this file (Python
floats, i.e. fp64, on the inputs as the op sees them): loss and gradient w.r.t. logp, fp32 and bf16 inputs, odd
sizes, padded [B, T] and packed [N] + cu_seqlens, empty masks, the MIS bounds exactly at their edges, cap = inf,
and is_weight=None bit for bit the uncorrected loss."""

import math

import pytest
import torch

import fastpo.kernels as K
from fastpo.kernels import functional as F

CLAMP = 20.0
MODES = ["token-mean", "seq-mean-token-mean"]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]  # gradient tolerance; bf16 gradients come back in bf16


# ------------------------------------------------------------------------------------------- the formulas
def _pg_token(lp, old, adv, eps_low=0.2, eps_high=0.28, clip_c=3.0):
    """(loss, d loss / d logp) of one token's clipped + dual-clipped surrogate."""
    raw = lp - old
    r = math.exp(min(max(raw, -CLAMP), CLAMP))
    pg1, pg2 = -adv * r, -adv * min(max(r, 1 - eps_low), 1 + eps_high)
    clipped = pg2 > pg1
    pg = pg2 if clipped else pg1
    dual = adv < 0 and pg > -adv * clip_c
    if dual:
        pg = -adv * clip_c
    return pg, 0.0 if clipped or dual or abs(raw) > CLAMP else -adv * r


def _agg_weights(mask, mode):
    """Aggregation weight of each token of a padded mask (list of rows of bools)."""
    n_all = sum(sum(row) for row in mask)
    out = []
    for row in mask:
        n_row = sum(row)
        w = 1 / max(n_all, 1) if mode == "token-mean" else 1 / (max(n_row, 1) * len(mask))
        out.append([w if m else 0.0 for m in row])
    return out


def _loss_truth(logp, old, adv, mask, c, ref, ent, mode, kl_coef, ent_coef):
    """(loss, dlogp, dentropy) of sum_t a_t (c_t pg_t + kl_coef k3_t - ent_coef ent_t), padded [B, T]."""
    rows = [[bool(x) for x in r] for r in mask.tolist()]
    agg = _agg_weights(rows, mode)
    vals = [x.double().tolist() for x in (logp, old, adv, c, ref, ent)]
    loss, d_lp, d_ent = 0.0, [], []
    for b, row in enumerate(rows):
        d_lp.append([0.0] * len(row))
        d_ent.append([0.0] * len(row))
        for t, m in enumerate(row):
            if not m:
                continue
            lp, o, a, ct, rf, e = (v[b][t] for v in vals)
            pg, dpg = _pg_token(lp, o, a)
            kl = math.exp(rf - lp) - (rf - lp) - 1
            loss += agg[b][t] * (ct * pg + kl_coef * kl - ent_coef * e)
            d_lp[b][t] = agg[b][t] * (ct * dpg + kl_coef * (1 - math.exp(rf - lp)))
            d_ent[b][t] = -ent_coef * agg[b][t]
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return f64(loss), f64(d_lp), f64(d_ent)


def _weights_truth(old, sample, mask, seqs, mode, cap, low, high):
    """(weights, stats) of offpolicy_weights; seqs: the token indices of each sequence (flat [N] inputs)."""
    o, s, m = old.double().tolist(), sample.double().tolist(), [bool(x) for x in mask.tolist()]
    lr = [min(max(o[i] - s[i], -CLAMP), CLAMP) if m[i] else 0.0 for i in range(len(m))]
    w, ratio, over, masked_seqs, seqs_with = [1.0] * len(m), [math.exp(x) for x in lr], [False] * len(m), 0, 0
    if mode in ("tis", "decoupled"):
        for i in range(len(m)):
            if m[i]:
                over[i] = ratio[i] > cap
                w[i] = min(ratio[i], cap) if mode == "tis" else (0.0 if over[i] else ratio[i])
    if mode == "mis":
        for idx in seqs:
            trained = [i for i in idx if m[i]]
            if not trained:
                continue
            seqs_with += 1
            mean = sum(lr[i] for i in trained) / len(trained)
            keep = (low == 0 or mean >= math.log(low)) and mean <= math.log(high)
            masked_seqs += not keep
            for i in trained:
                w[i], ratio[i] = (1.0 if keep else 0.0), math.exp(mean)
    trained = [i for i in range(len(m)) if m[i]]
    n = max(len(trained), 1)
    stats = {"ratio_mean": sum(ratio[i] for i in trained) / n if trained else 1.0,
             "ratio_max": max((ratio[i] for i in trained), default=1.0),
             "ratio_min": min((ratio[i] for i in trained), default=1.0),
             "clipped_frac": sum(over) / n, "masked_seq_frac": masked_seqs / max(seqs_with, 1),
             "masked_token_frac": sum(1 for i in trained if w[i] == 0.0) / n}
    return torch.tensor(w, dtype=torch.float64), stats


# ------------------------------------------------------------------------------------------------ data
def _batch(b, t, device, dtype=torch.float32):
    logp = (torch.randn(b, t, device=device) * 0.5 - 2).to(dtype)
    old = (logp.float() + 0.3 * torch.randn(b, t, device=device)).to(dtype)
    adv = torch.randn(b, t, device=device).to(dtype)
    mask = torch.rand(b, t, device=device) < 0.7
    mask[1] = False  # an empty row
    ref = (logp.float() + 0.2 * torch.randn(b, t, device=device)).to(dtype)
    ent = torch.rand(b, t, device=device).to(dtype)
    c = torch.rand(b, t, device=device) * 2.5
    c[0, :3] = 0.0  # dropped tokens: still in the denominator, still under KL and entropy
    return logp, old, adv, mask, ref, ent, c


def _run(logp, old, adv, mask, c, ref, ent, mode="token-mean", **kw):
    lp, e = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    loss, metrics = K.ppo_loss(lp, old, adv, mask, loss_agg_mode=mode, ref_logp=ref, kl_coef=0.05, kl_type="k3",
                               entropy=e, entropy_coef=0.01, is_weight=c, **kw)
    loss.backward()
    return loss, lp.grad, e.grad, metrics


# ------------------------------------------------------------------------------------------ ppo_loss + c
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,gtol", DTYPES)
def test_weighted_loss_and_gradient_match_the_formula(backend, device, mode, dtype, gtol):
    logp, old, adv, mask, ref, ent, c = _batch(5, 13, device, dtype)
    loss, g_lp, g_ent, _ = _run(logp, old, adv, mask, c, ref, ent, mode)
    t_loss, t_lp, t_ent = _loss_truth(logp.cpu(), old.cpu(), adv.cpu(), mask.cpu(), c.cpu(), ref.cpu(), ent.cpu(),
                                      mode, 0.05, 0.01)
    assert loss.dtype == torch.float32 and g_lp.dtype == dtype
    torch.testing.assert_close(loss.double().cpu(), t_loss, atol=1e-6, rtol=1e-5)
    scale = t_lp.abs().max().item()
    torch.testing.assert_close(g_lp.double().cpu(), t_lp, atol=gtol * scale, rtol=gtol)
    torch.testing.assert_close(g_ent.double().cpu(), t_ent, atol=gtol * t_ent.abs().max().item(), rtol=gtol)
    # the weight scales the clipped term only: a dropped token (c = 0) keeps its KL gradient
    assert (g_lp[0, :3][mask[0, :3]] != 0).all()


def test_weight_none_is_bit_for_bit_and_ones_change_nothing(backend, device):
    logp, old, adv, mask, ref, ent, _ = _batch(4, 11, device)
    plain = K.ppo_loss(logp.clone().requires_grad_(True), old, adv, mask, ref_logp=ref, kl_coef=0.05,
                       entropy=ent, entropy_coef=0.01)
    runs = []
    for c in (None, torch.ones_like(logp)):
        lp = logp.clone().requires_grad_(True)
        loss, metrics = K.ppo_loss(lp, old, adv, mask, ref_logp=ref, kl_coef=0.05, entropy=ent, entropy_coef=0.01,
                                   is_weight=c)
        loss.backward()
        runs.append((loss, lp.grad, metrics))
    assert torch.equal(runs[0][0], plain[0])
    for loss, grad, metrics in runs[1:]:  # x * 1.0 is exact: the same bits through either backend
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][1])
        assert all(torch.equal(metrics[k], runs[0][2][k]) for k in metrics)


def test_weight_scales_the_clipped_term_linearly(backend, device):
    """Without KL and entropy, loss and gradient are linear in c: c = 2 doubles both, c = 0 zeroes both."""
    logp, old, adv, mask, _, _, _ = _batch(3, 7, device)
    out = []
    for c in (1.0, 2.0, 0.0):
        lp = logp.clone().requires_grad_(True)
        loss, _ = K.ppo_loss(lp, old, adv, mask, is_weight=torch.full_like(logp, c))
        loss.backward()
        out.append((loss, lp.grad))
    torch.testing.assert_close(out[1][0], 2 * out[0][0])
    torch.testing.assert_close(out[1][1], 2 * out[0][1])
    assert out[2][0].item() == 0.0 and torch.equal(out[2][1], torch.zeros_like(out[2][1]))


@pytest.mark.parametrize("mode", MODES)
def test_packed_matches_padded(backend, device, mode):
    lens = [5, 0, 3, 8, 1]
    t_max = max(lens)
    logp, old, adv, mask, ref, ent, c = _batch(len(lens), t_max, device)
    valid = torch.arange(t_max, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    mask &= valid
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    pad = _run(logp, old, adv, mask, c, ref, ent, mode)
    packed = _run(*(x[valid] for x in (logp, old, adv, mask, c, ref, ent)), mode, cu_seqlens=cu)
    torch.testing.assert_close(packed[0], pad[0])
    torch.testing.assert_close(packed[1], pad[1][valid])
    torch.testing.assert_close(packed[2], pad[2][valid])


def test_empty_mask_and_junk_off_the_mask(backend, device):
    logp, old, adv, mask, ref, ent, c = _batch(3, 5, device)
    c_dirty = torch.where(mask, c, torch.full_like(c, float("nan")))
    loss, g_lp, _, _ = _run(logp, old, adv, torch.zeros_like(mask), c_dirty, ref, ent)
    assert loss.item() == 0.0 and torch.equal(g_lp, torch.zeros_like(g_lp))
    clean = _run(logp, old, adv, mask, c, ref, ent)
    dirty = _run(logp, old, adv, mask, c_dirty, ref, ent)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    empty = torch.zeros(0, device=device)
    loss, g_lp, _, _ = _run(empty, empty, empty, empty.bool(), empty, empty, empty)
    assert loss.item() == 0.0 and g_lp.shape == (0,)


def test_is_weight_is_a_constant_and_is_checked(device):
    logp, old, adv, mask, _, _, c = _batch(2, 3, device)
    c = c.requires_grad_(True)
    lp = logp.clone().requires_grad_(True)
    K.ppo_loss(lp, old, adv, mask, is_weight=c)[0].backward()
    assert c.grad is None and lp.grad is not None
    with pytest.raises(ValueError, match=r"is_weight must have shape \(2, 3\)"):
        K.ppo_loss(logp, old, adv, mask, is_weight=c[:, :2])
    with pytest.raises(ValueError, match="is_weight must be a floating-point"):
        K.ppo_loss(logp, old, adv, mask, is_weight=mask)


def test_opcheck_with_is_weight(monkeypatch):
    monkeypatch.setenv("FASTPO_KERNELS", "torch")
    lp, mask, w = torch.randn(2, 4, requires_grad=True), torch.rand(2, 4) < 0.6, torch.full((2, 4), 0.125)
    args = (lp, lp.detach() + 0.1, torch.randn(2, 4), w, mask, lp.detach(), torch.rand(2, 4, requires_grad=True),
            0.2, 0.28, 3.0, 0.1, 1, 0.01, True, torch.rand(2, 4) * 2)
    torch.library.opcheck(torch.ops.fastpo.ppo_loss.default, args)


# ------------------------------------------------------------------------------------- offpolicy_weights
def _seqs(lens):
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    return [list(range(cu[i], cu[i + 1])) for i in range(len(lens))], torch.tensor(cu)


def _check(weights, stats, want_w, want_stats, mask):
    assert weights.dtype == torch.float32 and weights.shape == mask.shape
    torch.testing.assert_close(weights.double().cpu().reshape(-1), want_w, atol=1e-6, rtol=1e-5)
    assert set(stats) == set(want_stats)
    for k, v in want_stats.items():
        assert stats[k].dim() == 0 and stats[k].dtype == torch.float32, k
        assert stats[k].item() == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "decoupled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_packed_match_the_formula(device, mode, dtype):
    lens = [7, 0, 3, 12, 1, 5]  # an empty sequence, a one-token one, odd lengths
    seqs, cu = _seqs(lens)
    n = sum(lens)
    sample = (torch.randn(n) * 0.5 - 2).to(dtype)
    old = (sample.float() + 0.4 * torch.randn(n)).to(dtype)
    mask = torch.rand(n) < 0.8
    mask[seqs[4]] = False  # a sequence without trained tokens
    old[~mask] = float("nan")  # never read off the mask
    cap, low, high = 1.3, 0.85, 1.15
    weights, stats = F.offpolicy_weights(old.to(device), sample.to(device), mask.to(device), mode, cap, low, high,
                                         cu_seqlens=cu.to(device))
    want_w, want_stats = _weights_truth(old, sample, mask, seqs, mode, cap, low, high)
    _check(weights, stats, want_w, want_stats, mask)
    if mode in ("tis", "decoupled"):
        assert 0 < stats["clipped_frac"].item() < 1  # the data reaches the cap: the branch is exercised
    if mode == "mis":
        assert 0 < stats["masked_seq_frac"].item() < 1


@pytest.mark.parametrize("mode", ["tis", "mis", "decoupled"])
def test_weights_padded_equal_packed(device, mode):
    lens = [4, 9, 2]
    b, t = len(lens), max(lens)
    valid = torch.arange(t)[None, :] < torch.tensor(lens)[:, None]
    old, sample = torch.randn(b, t) * 0.3, torch.randn(b, t) * 0.3
    mask = (torch.rand(b, t) < 0.9) & valid
    kw = dict(cap=1.2, low=0.9, high=1.1)
    w_pad, s_pad = F.offpolicy_weights(old.to(device), sample.to(device), mask.to(device), mode, **kw)
    _, cu = _seqs(lens)
    w_pk, s_pk = F.offpolicy_weights(old[valid].to(device), sample[valid].to(device), mask[valid].to(device), mode,
                                     **kw, cu_seqlens=cu.to(device))
    torch.testing.assert_close(w_pk, w_pad[valid.to(device)])
    for k in s_pad:
        torch.testing.assert_close(s_pk[k], s_pad[k], msg=k)
    want_w, want_stats = _weights_truth(old[valid], sample[valid], mask[valid], _seqs(lens)[0], mode, 1.2, 0.9, 1.1)
    _check(w_pk, s_pk, want_w, want_stats, mask[valid])


def _one_seq(log_ratio, device, k=8):
    """k trained tokens whose log-ratio old - sample is exactly ``log_ratio`` (representable: the mean is exact)."""
    sample = torch.full((k,), -1.0, device=device)
    return sample + log_ratio, sample, torch.ones(k, dtype=torch.bool, device=device), torch.tensor([0, k],
                                                                                                  device=device)


@pytest.mark.parametrize("log_ratio", [-0.5, 0.5])
def test_mis_bounds_are_inclusive_at_the_edges(device, log_ratio):
    old, sample, mask, cu = _one_seq(log_ratio, device)
    edge = math.exp(log_ratio)  # rho exactly at the bound: kept
    low, high = (edge, 2.0) if log_ratio < 0 else (0.5, edge)
    w, st = F.offpolicy_weights(old, sample, mask, "mis", low=low, high=high, cu_seqlens=cu)
    assert torch.equal(w, torch.ones_like(w)) and st["masked_seq_frac"].item() == 0.0
    # the bound moved 1e-6 in log space (~17 fp32 steps at 0.5) past the ratio: masked, every token of it
    step = 1e-6
    low, high = (math.exp(log_ratio + step), 2.0) if log_ratio < 0 else (0.5, math.exp(log_ratio - step))
    w, st = F.offpolicy_weights(old, sample, mask, "mis", low=low, high=high, cu_seqlens=cu)
    assert torch.equal(w, torch.zeros_like(w))
    assert st["masked_seq_frac"].item() == 1.0 and st["masked_token_frac"].item() == 1.0
    assert st["ratio_mean"].item() == pytest.approx(math.exp(log_ratio), rel=1e-6)


def test_open_bounds_and_infinite_cap_do_not_correct(device):
    """mis with [0, inf) keeps every sequence (weights exactly 1); cap = inf neither truncates (tis) nor drops
    (decoupled): the weight is the plain ratio, clamped at exp(20) like the PPO ratio."""
    log_ratio = torch.tensor([0.0, 3.0, -2.0, 30.0, -40.0], device=device)
    sample = torch.full_like(log_ratio, -5.0)
    old, mask, cu = sample + log_ratio, torch.ones(5, dtype=torch.bool, device=device), torch.tensor([0, 2, 5],
                                                                                                       device=device)
    w, st = F.offpolicy_weights(old, sample, mask, "mis", low=0.0, high=math.inf, cu_seqlens=cu)
    assert torch.equal(w, torch.ones_like(w)) and st["masked_seq_frac"].item() == 0.0
    want = torch.exp(log_ratio.clamp(-20, 20))
    for mode in ("tis", "decoupled"):
        w, st = F.offpolicy_weights(old, sample, mask, mode, cap=math.inf)
        torch.testing.assert_close(w, want)
        assert st["clipped_frac"].item() == 0.0 and st["masked_token_frac"].item() == 0.0
        assert st["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_matching_logprobs_leave_the_loss_bit_for_bit(backend, device):
    """sample == old: every mode gives weights of exactly 1, so the corrected loss is the uncorrected one."""
    logp, old, adv, mask, ref, ent, _ = _batch(4, 9, device)
    base = _run(logp, old, adv, mask, None, ref, ent)
    for mode in ("tis", "mis", "decoupled"):
        w, _ = F.offpolicy_weights(old.reshape(-1), old.reshape(-1), mask.reshape(-1), mode,
                                   cu_seqlens=torch.arange(0, 37, 9, device=device))
        assert torch.equal(w, torch.ones_like(w)), mode
        got = _run(logp, old, adv, mask, w.view(4, 9), ref, ent)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), mode


def test_weights_of_an_empty_mask_are_neutral(device):
    for shape, cu in (((3, 4), None), ((0,), torch.tensor([0], device=device)), ((6,), torch.tensor([0, 2, 6]))):
        cu = cu.to(device) if cu is not None else None
        x = torch.randn(shape, device=device)
        for mode in ("tis", "mis", "decoupled"):
            w, st = F.offpolicy_weights(x, x - 1.0, torch.zeros(shape, dtype=torch.bool, device=device), mode,
                                        cu_seqlens=cu)
            assert torch.equal(w, torch.ones(shape, device=device))
            assert {k: v.item() for k, v in st.items()} == {
                "ratio_mean": 1.0, "ratio_max": 1.0, "ratio_min": 1.0, "clipped_frac": 0.0, "masked_seq_frac": 0.0,
                "masked_token_frac": 0.0}


@pytest.mark.parametrize("call,match", [
    (lambda x, m: F.offpolicy_weights(x, x, m, "is"), "mode must be one of"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "tis", cap=1.0), r"cap must lie in \(1.0"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "mis", low=1.0), r"low must lie in \[0, 1\)"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "mis", low=-0.1), r"low must lie in \[0, 1\), got -0.1"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "mis", high=1.0), r"high must lie in \(1.0"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "tis", cap=float("nan")), "cap must be a number"),
    (lambda x, m: F.offpolicy_weights(x, x[:2], m, "tis"), r"sample_logp must have shape \(6,\)"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "mis"), "mode='mis' on a packed"),
    (lambda x, m: F.offpolicy_weights(x, x, m, "mis", cu_seqlens=torch.tensor([0, 7])), "cu_seqlens must start"),
])
def test_weights_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(6), torch.ones(6, dtype=torch.bool))
