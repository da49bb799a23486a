"""Drop-in modules against TRL's GRPO loss formula per loss_type, written out here: loss, metrics, gradients."""

import pytest
import torch
from _truth import logits_logprob_truth, logprob_truth

from fastpo.kernels import FastPOFusedLinearGRPOLoss, FastPOGRPOLoss


def trl_grpo_loss(logp, old, advantages, mask, ref, beta, eps_low, eps_high, loss_type, max_len):
    """TRL GRPOTrainer._compute_loss (token-level importance sampling, one process)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * kl
    m = mask.double()
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (per_token.size(0) * max_len)
    adv = advantages[:, None]
    is_clipped = ((coef_1 < 1 - eps_low) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0))
    clip_ratio = (is_clipped.double() * m).sum() / m.sum().clamp(min=1.0)
    metrics = ([(kl * m).sum() / m.sum().clamp(min=1.0)] if kl is not None else []) + [clip_ratio]
    return loss, metrics


def _batch(device, b=4, t=6, h=16, v=300):
    hidden = torch.randn(b, t, h, device=device)
    weight = torch.randn(v, h, device=device) * 0.3
    bias = torch.randn(v, device=device) * 0.1
    ids = torch.randint(0, v, (b, t), device=device)
    mask = torch.rand(b, t, device=device) < 0.75
    mask[2] = False
    advantages = torch.randn(b, device=device)
    with torch.no_grad():
        logp, _ = logprob_truth(hidden, weight, ids, bias)
    old = (logp + 0.2 * torch.randn_like(logp)).float()
    ref = (logp + 0.1 * torch.randn_like(logp)).float()
    return hidden, weight, bias, ids, mask, advantages, old, ref


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_fused_linear_grpo_loss_matches_trl(fused_backend, device, loss_type, beta):
    hidden, weight, bias, ids, mask, advantages, old, ref = _batch(device)
    module = FastPOFusedLinearGRPOLoss(beta=beta, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type,
                                       temperature=0.9, max_completion_length=8)
    h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    loss, metrics = module(h, w, ids, mask, advantages, b, ref, old)
    loss.backward()
    th, tw, tb = (x.double().requires_grad_(True) for x in (hidden, weight, bias))
    logp, _ = logprob_truth(th, tw, ids, tb, 0.9)
    t_loss, t_metrics = trl_grpo_loss(logp, old.double(), advantages.double(), mask, ref.double(), beta, 0.2, 0.28,
                                      loss_type, 8)
    t_loss.backward()
    torch.testing.assert_close(loss.double(), t_loss, atol=1e-5, rtol=1e-5)
    assert len(metrics) == len(t_metrics)
    for got, want in zip(metrics, t_metrics, strict=True):
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    for got, want in ((h.grad, th.grad), (w.grad, tw.grad), (b.grad, tb.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_on_policy_when_old_logp_is_none(backend, device):
    """old_logp None -> ratio 1: the loss is -mean(A) over tokens and nothing is clipped."""
    hidden, weight, _, ids, mask, advantages, _, _ = _batch(device)
    loss, metrics = FastPOFusedLinearGRPOLoss(beta=0.0, loss_type="bnpo")(hidden, weight, ids, mask, advantages)
    m = mask.float()
    want = -(advantages[:, None] * m).sum() / m.sum()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert len(metrics) == 1 and metrics[0].item() == 0.0


def test_ref_logp_from_ref_model_inputs(backend, device):
    hidden, weight, bias, ids, mask, advantages, old, _ = _batch(device)
    ref_hidden, ref_weight = hidden + 0.1, weight * 0.9
    module = FastPOFusedLinearGRPOLoss(beta=0.1, loss_type="grpo")
    loss, metrics = module(hidden, weight, ids, mask, advantages, bias, None, old, ref_hidden, ref_weight, bias)
    ref_logp, _ = logprob_truth(ref_hidden, ref_weight, ids, bias)
    loss2, metrics2 = module(hidden, weight, ids, mask, advantages, bias, ref_logp.float(), old)
    torch.testing.assert_close(loss, loss2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(metrics[0], metrics2[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_grpo_loss_on_logits_matches_trl(backend, device, loss_type):
    logits = torch.randn(3, 6, 50, device=device) * 2
    ids = torch.randint(0, 50, (3, 5), device=device)
    mask = torch.rand(3, 5, device=device) < 0.8
    advantages = torch.randn(3, device=device)
    old = logits_logprob_truth(logits[:, :-1], ids)[0].float() + 0.1
    ref = old - 0.05
    leaf = logits.clone().requires_grad_(True)
    loss, metrics = FastPOGRPOLoss(beta=0.04, loss_type=loss_type, max_completion_length=5)(
        leaf[:, :-1], ids, mask, advantages, ref, old)
    loss.backward()
    t_leaf = logits.double().requires_grad_(True)
    logp, _ = logits_logprob_truth(t_leaf[:, :-1], ids)
    t_loss, t_metrics = trl_grpo_loss(logp, old.double(), advantages.double(), mask, ref.double(), 0.04, 0.2, 0.2,
                                      loss_type, 5)
    t_loss.backward()
    torch.testing.assert_close(loss.double(), t_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), t_leaf.grad, atol=1e-6, rtol=1e-4)
    for got, want in zip(metrics, t_metrics, strict=True):
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)


def test_module_argument_errors():
    with pytest.raises(ValueError, match="loss_type"):
        FastPOFusedLinearGRPOLoss(loss_type="sapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        FastPOFusedLinearGRPOLoss(loss_type="dr_grpo")
    hidden, weight, _, ids, mask, advantages, _, _ = _batch("cpu")
    with pytest.raises(ValueError, match="ref_logp"):
        FastPOFusedLinearGRPOLoss(beta=0.04)(hidden, weight, ids, mask, advantages)
    with pytest.raises(ValueError, match="hidden"):
        FastPOFusedLinearGRPOLoss(beta=0.0)(hidden[0], weight, ids, mask, advantages)
