"""ppo_loss and value_loss against per-token formulas in fp64 (values and gradients), hand-checked clip
boundaries, aggregation modes, padded vs packed layouts, masks (empty rows, fully masked batch, NaN off-mask)."""

import math

import pytest
import torch
from _truth import aggregate, ppo_per_token

import fastpo.kernels as K
from fastpo.kernels import reference as ref

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)]  # inputs rounded to bf16; compute is fp32 either way


def _batch(b, t, device, dtype=torch.float32, empty_row=True):
    logp = (torch.randn(b, t, device=device) * 0.5 - 2).to(dtype)
    old = (logp.float() + 0.3 * torch.randn(b, t, device=device)).to(dtype)
    adv = torch.randn(b, t, device=device).to(dtype)
    mask = torch.rand(b, t, device=device) < 0.7
    if empty_row:
        mask[1] = False
    ref_logp = (logp.float() + 0.2 * torch.randn(b, t, device=device)).to(dtype)
    entropy = torch.rand(b, t, device=device).to(dtype)
    return logp, old, adv, mask, ref_logp, entropy


def _truth(logp, old, adv, mask, ref_logp, entropy, mode, kl_coef, kl_type, ent_coef, eps=(0.2, 0.28), clip_c=3.0):
    lp = logp.detach().double().requires_grad_(True)
    ent = entropy.detach().double().requires_grad_(True)
    pg, kl = ppo_per_token(lp, old.double(), adv.double(), eps[0], eps[1], clip_c, ref_logp.double(), kl_type)
    loss = aggregate(pg, mask, mode) + kl_coef * aggregate(kl, mask, mode) - ent_coef * aggregate(ent, mask, mode)
    loss.backward()
    return loss, lp.grad, ent.grad, kl


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_ppo_loss_matches_truth(backend, device, mode, kl_type):
    logp, old, adv, mask, ref_logp, entropy = _batch(5, 13, device)
    lp = logp.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    loss, metrics = K.ppo_loss(lp, old, adv, mask, loss_agg_mode=mode, ref_logp=ref_logp, kl_coef=0.05,
                               kl_type=kl_type, entropy=ent, entropy_coef=0.01)
    loss.backward()
    t_loss, t_glp, t_gent, t_kl = _truth(logp, old, adv, mask, ref_logp, entropy, mode, 0.05, kl_type, 0.01)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), t_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp.grad.double(), t_glp, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ent.grad.double(), t_gent, atol=1e-7, rtol=1e-5)
    m = mask.double()
    ratio = torch.exp(logp.double() - old.double())
    clipped = ((ratio > 1.28) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    expect = {
        "clipfrac": (clipped.double() * m).sum() / m.sum(),
        "clipfrac_lower": (((adv < 0) & (ratio > 3.0)).double() * m).sum() / m.sum(),
        "approx_kl": ((old.double() - logp.double()) * m).sum() / m.sum(),
        "entropy": (entropy.double() * m).sum() / m.sum(),
        "kl": (t_kl.detach() * m).sum() / m.sum(),
    }
    assert set(metrics) == set(expect)
    for k, v in expect.items():
        torch.testing.assert_close(metrics[k].double(), v, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_ppo_loss_input_dtypes(backend, device, dtype, atol):
    logp, old, adv, mask, ref_logp, entropy = _batch(4, 9, device, dtype)
    lp = logp.clone().requires_grad_(True)
    loss, _ = K.ppo_loss(lp, old, adv, mask, ref_logp=ref_logp, kl_coef=0.1)
    loss.backward()
    t_loss, t_glp, _, _ = _truth(logp, old, adv, mask, ref_logp, entropy, "token-mean", 0.1, "k1", 0.0)
    torch.testing.assert_close(loss.double(), t_loss, atol=atol, rtol=1e-5)
    assert lp.grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(lp.grad.double(), t_glp, atol=tol * t_glp.abs().max().item(), rtol=tol)


def test_ppo_loss_per_sequence_advantages_and_no_extras(backend, device):
    logp, old, _, mask, _, _ = _batch(3, 6, device, empty_row=False)
    adv_seq = torch.tensor([1.0, -2.0, 0.5], device=device)
    loss, metrics = K.ppo_loss(logp, old, adv_seq, mask, eps_low=0.1, eps_high=0.1)
    want, _ = ppo_per_token(logp.double(), old.double(), adv_seq.double()[:, None].expand(3, 6), 0.1, 0.1, 3.0)
    torch.testing.assert_close(loss.double(), aggregate(want, mask, "token-mean"), atol=1e-6, rtol=1e-5)
    assert set(metrics) == {"clipfrac", "clipfrac_lower", "approx_kl"}


def _single(logp, old, adv, device="cpu", **kw):
    f64 = dict(dtype=torch.float64, device=device)
    lp = torch.tensor([logp], **f64, requires_grad=True)
    loss, metrics = K.ppo_loss(lp, torch.tensor([old], **f64), torch.tensor([adv], **f64),
                               torch.ones(1, dtype=torch.bool, device=device), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


@pytest.mark.parametrize("adv,ratio,loss,grad,clipped,dual", [
    # A > 0, upper bound 1 + eps_high = 1.28: inside -> -A r with gradient -A r; beyond -> -A 1.28, no gradient
    (1.0, 1.25, -1.25, -1.25, 0, 0),
    (1.0, 1.28, -1.28, -1.28, 0, 0),
    (1.0, 1.30, -1.28, 0.0, 1, 0),
    # A < 0, lower bound 1 - eps_low = 0.8
    (-1.0, 0.85, 0.85, 0.85, 0, 0),
    (-1.0, 0.80, 0.80, 0.80, 0, 0),
    (-1.0, 0.75, 0.80, 0.0, 1, 0),
    # A < 0 and a large ratio: the dual clip caps the loss at -A * clip_c = 6
    (-2.0, 2.9, 5.8, 5.8, 0, 0),
    (-2.0, 3.0, 6.0, 6.0, 0, 0),
    (-2.0, 3.5, 6.0, 0.0, 0, 1),
    # A > 0 and a large ratio: no dual clip, only the asymmetric one
    (2.0, 3.5, -2.56, 0.0, 1, 0),
])
def test_clip_boundaries_hand_checked(backend, device, adv, ratio, loss, grad, clipped, dual):
    """At a bound (ratio = exp(log(bound)), exact up to rounding) both branches give the same value; the clip
    branch is taken only strictly beyond it. The Triton path computes in fp32, hence the 1e-6."""
    got_loss, got_grad, metrics = _single(math.log(ratio), 0.0, adv, device, eps_low=0.2, eps_high=0.28, clip_c=3.0)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    if ratio not in (1.28, 0.80, 3.0):  # at the exact bound the gradient is one branch's or the other's
        assert got_grad == pytest.approx(grad, abs=1e-6)
        assert metrics["clipfrac"].item() == clipped and metrics["clipfrac_lower"].item() == dual


def test_log_ratio_clamp(backend, device):
    """|logp - old_logp| > 20 is clamped (as verl): the loss stays finite and the token has no gradient."""
    got_loss, got_grad, metrics = _single(25.0, 0.0, 1.0, device, clip_c=3.0, eps_high=1e30)
    assert got_loss == pytest.approx(-math.exp(20.0), rel=1e-5) and got_grad == 0.0
    got_loss, got_grad, _ = _single(19.0, 0.0, 1.0, device, eps_high=1e30)
    assert got_loss == pytest.approx(-math.exp(19.0), rel=1e-5) and got_grad == pytest.approx(-math.exp(19.0), rel=1e-5)
    assert metrics["approx_kl"].item() == pytest.approx(-20.0)


def test_dual_clip_disabled_with_inf(backend, device):
    got_loss, got_grad, metrics = _single(math.log(5.0), 0.0, -1.0, device, clip_c=math.inf)
    assert got_loss == pytest.approx(5.0) and got_grad == pytest.approx(5.0)
    assert metrics["clipfrac_lower"].item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_is_finite_zero(backend, device, mode):
    logp, old, adv, mask, ref_logp, entropy = _batch(3, 5, device)
    logp[0, 0] = float("nan")
    old[1, 2] = float("inf")
    lp = logp.clone().requires_grad_(True)
    loss, metrics = K.ppo_loss(lp, old, adv, torch.zeros_like(mask), loss_agg_mode=mode, ref_logp=ref_logp,
                               kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp.grad))
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in metrics.values())
    vl, vm = K.value_loss(lp, old, adv, torch.zeros_like(mask), loss_agg_mode=mode)
    assert vl.item() == 0.0 and vm["clipfrac"].item() == 0.0


def test_nan_off_mask_does_not_leak(backend, device):
    logp, old, adv, mask, ref_logp, entropy = _batch(4, 8, device)
    clean, _ = K.ppo_loss(logp, old, adv, mask, ref_logp=ref_logp, kl_coef=0.1, kl_type="k3")
    dirty_lp = torch.where(mask, logp, torch.full_like(logp, float("nan"))).requires_grad_(True)
    dirty_old = torch.where(mask, old, torch.full_like(old, -float("inf")))
    loss, _ = K.ppo_loss(dirty_lp, dirty_old, adv, mask, ref_logp=ref_logp, kl_coef=0.1, kl_type="k3")
    loss.backward()
    torch.testing.assert_close(loss, clean)
    assert torch.isfinite(dirty_lp.grad).all() and (dirty_lp.grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_packed_matches_padded(backend, device, mode):
    lens = [5, 0, 3, 8]
    t_max = max(lens)
    logp, old, adv, mask, ref_logp, entropy = _batch(4, t_max, device, empty_row=False)
    for b, n in enumerate(lens):
        mask[b, n:] = False
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
    valid = torch.arange(t_max, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    pack = lambda x: x[valid]
    lp = logp.clone().requires_grad_(True)
    lp_packed = pack(logp).clone().requires_grad_(True)
    kw = dict(loss_agg_mode=mode, ref_logp=None, norm_len=t_max)
    loss, met = K.ppo_loss(lp, old, adv, mask, **kw)
    loss_p, met_p = K.ppo_loss(lp_packed, pack(old), pack(adv), pack(mask), cu_seqlens=cu, **kw)
    loss.backward()
    loss_p.backward()
    torch.testing.assert_close(loss_p, loss)
    torch.testing.assert_close(lp_packed.grad, pack(lp.grad))
    for k in met:
        torch.testing.assert_close(met_p[k], met[k])
    v = logp.clone().requires_grad_(True)
    v_p = pack(logp).clone().requires_grad_(True)
    vl, _ = K.value_loss(v, old, adv, mask, loss_agg_mode=mode, norm_len=t_max)
    vl_p, _ = K.value_loss(v_p, pack(old), pack(adv), pack(mask), loss_agg_mode=mode, cu_seqlens=cu, norm_len=t_max)
    vl.backward()
    vl_p.backward()
    torch.testing.assert_close(vl_p, vl)
    torch.testing.assert_close(v_p.grad, pack(v.grad))


def test_seq_mean_token_sum_norm_default_is_padded_width(backend, device):
    logp, old, adv, mask, _, _ = _batch(3, 10, device)
    loss, _ = K.ppo_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum-norm")
    pg, _ = ppo_per_token(logp.double(), old.double(), adv.double(), 0.2, 0.28, 3.0)
    torch.testing.assert_close(loss.double(), (pg * mask).sum() / 10, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_loss_matches_truth(backend, device, mode, dtype):
    b, t = 4, 11
    values = torch.randn(b, t, device=device).to(dtype)
    old = (values.float() + 0.6 * torch.randn(b, t, device=device)).to(dtype)
    returns = torch.randn(b, t, device=device).to(dtype)
    mask = torch.rand(b, t, device=device) < 0.7
    v = values.clone().requires_grad_(True)
    loss, metrics = K.value_loss(v, old, returns, mask, clip=0.5, loss_agg_mode=mode)
    loss.backward()
    v64 = values.detach().double().requires_grad_(True)
    clipped_v = old.double() + (v64 - old.double()).clamp(-0.5, 0.5)
    l1, l2 = (v64 - returns.double()) ** 2, (clipped_v - returns.double()) ** 2
    want = 0.5 * aggregate(torch.maximum(l1, l2), mask, mode)
    want.backward()
    torch.testing.assert_close(loss.double(), want, atol=1e-6, rtol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(v.grad.double(), v64.grad, atol=tol * v64.grad.abs().max().item(), rtol=tol)
    frac = ((l2 > l1).double() * mask).sum() / mask.sum()
    torch.testing.assert_close(metrics["clipfrac"].double(), frac.detach(), atol=1e-6, rtol=0)


def test_value_loss_clip_hand_checked(backend, device):
    """V_old = 0, clip 0.5: V = 1 -> clipped value 0.5; R = 2: max((1-2)^2, (0.5-2)^2) = 2.25, loss 1.125, and the
    clipped branch has no gradient in V (the clip is active)."""
    f64 = dict(dtype=torch.float64, device=device)
    v = torch.tensor([1.0], **f64, requires_grad=True)
    loss, metrics = K.value_loss(v, torch.zeros(1, **f64), torch.tensor([2.0], **f64), torch.ones(1, device=device))
    loss.backward()
    assert loss.item() == pytest.approx(1.125) and v.grad.item() == 0.0 and metrics["clipfrac"].item() == 1.0
    v = torch.tensor([0.3], **f64, requires_grad=True)  # inside the clip range: plain MSE
    loss, _ = K.value_loss(v, torch.zeros(1, **f64), torch.tensor([2.0], **f64), torch.ones(1, device=device))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 1.7**2, rel=1e-6) and v.grad.item() == pytest.approx(-1.7, rel=1e-6)


def test_gradcheck_ppo_and_value_loss(monkeypatch):
    monkeypatch.setenv("FASTPO_KERNELS", "torch")
    logp, old, adv, mask, ref_logp, entropy = (x.double() for x in _batch(3, 6, "cpu"))
    mask = mask.bool()
    lp = logp.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    for mode in MODES:
        def fn(a, e, mode=mode):
            return K.ppo_loss(a, old, adv, mask, loss_agg_mode=mode, ref_logp=ref_logp, kl_coef=0.3, kl_type="k3",
                              entropy=e, entropy_coef=0.05)[0]

        assert torch.autograd.gradcheck(fn, (lp, ent))
    fn = lambda v: K.value_loss(v, old, adv, mask, clip=0.2)[0]
    assert torch.autograd.gradcheck(fn, (lp,))


def test_aggregation_weights_modes():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    w = {m: ref.aggregation_weights(mask, m) for m in MODES}
    assert torch.allclose(w["token-mean"].sum(), torch.tensor(1.0))
    assert torch.allclose(w["seq-mean-token-sum"][0], torch.tensor([1 / 3, 1 / 3, 0]))
    assert torch.allclose(w["seq-mean-token-mean"][2], torch.full((3,), 1 / 9))
    assert torch.allclose(w["seq-mean-token-sum-norm"][2], torch.full((3,), 1 / 3))
