"""Bad input raises ValueError naming the argument and what was expected."""

import pytest
import torch

import fastpo.kernels as K

x = torch.randn(2, 3)
m = torch.ones(2, 3, dtype=torch.bool)
hidden, weight, ids = torch.randn(2, 3, 4), torch.randn(10, 4), torch.randint(0, 10, (2, 3))

CASES = [
    (lambda: K.selective_logprob(torch.randn(2, 5), torch.zeros(3, dtype=torch.long)), r"ids must have shape \(2,\)"),
    (lambda: K.selective_logprob(torch.randn(2, 5), torch.zeros(2)), "ids must be an integer tensor"),
    (lambda: K.selective_logprob(torch.randn(5), torch.zeros((), dtype=torch.long)), "logits must be"),
    (lambda: K.selective_logprob(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), 0.0), "temperature"),
    (lambda: K.fused_linear_logprob(hidden, weight.double(), ids), "weight must have hidden's dtype"),
    (lambda: K.fused_linear_logprob(hidden, torch.randn(10, 5), ids), r"weight must be \[V, H\]"),
    (lambda: K.fused_linear_logprob(hidden, weight, ids[:, :2]), r"ids must have shape \(2, 3\)"),
    (lambda: K.fused_linear_logprob(hidden, weight, ids, torch.randn(9)), r"bias must have shape \(10,\)"),
    (lambda: K.fused_linear_logprob(hidden, weight, ids, temperature=-1.0), "temperature"),
    (lambda: K.fused_linear_logprob(hidden.numpy(), weight, ids), "hidden must be a torch.Tensor"),
    (lambda: K.ppo_loss(x, x, x, m, loss_agg_mode="mean"), "loss_agg_mode must be one of"),
    (lambda: K.ppo_loss(x, x, x, m, kl_type="k2", ref_logp=x, kl_coef=0.1), "kl_type must be one of"),
    (lambda: K.ppo_loss(x, x, x, m, kl_coef=0.1), "ref_logp is required"),
    (lambda: K.ppo_loss(x, x[:, :2], x, m), r"old_logp must have shape \(2, 3\)"),
    (lambda: K.ppo_loss(x, x, torch.randn(3), m), "advantages must have shape"),
    (lambda: K.ppo_loss(x, x, x, m[:, :2]), r"mask must have shape \(2, 3\)"),
    (lambda: K.ppo_loss(x, x, x, m, ref_logp=x[0], kl_coef=0.1), "ref_logp must have shape"),
    (lambda: K.ppo_loss(x, x, x, m, entropy=x.long()), "entropy must be a floating-point"),
    (lambda: K.ppo_loss(x, x, x, m, clip_c=1.0), r"clip_c must lie in \(1.0"),
    (lambda: K.ppo_loss(x, x, x, m, eps_low=1.5), "eps_low must lie in"),
    (lambda: K.ppo_loss(x, x, x, m, eps_high="0.2"), "eps_high must be a number"),
    (lambda: K.ppo_loss(x.reshape(-1), x.reshape(-1), x.reshape(-1), m.reshape(-1),
                        loss_agg_mode="seq-mean-token-mean"), "needs cu_seqlens"),
    (lambda: K.ppo_loss(x, x, x, m, cu_seqlens=torch.tensor([0, 3, 6])), "with cu_seqlens, mask must be packed"),
    (lambda: K.ppo_loss(x.reshape(-1), x.reshape(-1), x.reshape(-1), m.reshape(-1), cu_seqlens=torch.tensor([0.0])),
     "cu_seqlens must be an integer tensor"),
    (lambda: K.value_loss(x, x, x[0], m), r"returns must have shape \(2, 3\)"),
    (lambda: K.value_loss(x, x, x, m, clip=-0.1), "clip must lie in"),
    (lambda: K.value_loss(x, x, x, m, loss_agg_mode="sum"), "loss_agg_mode must be one of"),
    (lambda: K.gae_advantages(x, x[:, :2], m), r"values must have shape \(2, 3\)"),
    (lambda: K.gae_advantages(x, x, m, gamma=1.5), "gamma must lie in"),
    (lambda: K.gae_advantages(x, x, m, lam=-0.1), "lam must lie in"),
    (lambda: K.gae_advantages(x.long(), x, m), "rewards must be a floating-point"),
    (lambda: K.bilevel_gae_advantages(x, x, m, m[:, :1]), r"turn_end must have shape \(2, 3\)"),
    (lambda: K.bilevel_gae_advantages(x, x, m, m, gamma_high=2.0), "gamma_high must lie in"),
    (lambda: K.grpo_advantages(torch.randn(2), torch.tensor([0.0, 1.0]), m), "group_ids must be an integer"),
    (lambda: K.grpo_advantages(torch.randn(3), torch.tensor([0, 1, 1]), m), r"scores must have one entry per"),
    (lambda: K.grpo_advantages(torch.randn(2, 3), torch.tensor([0, 1]), m), r"scores must be \[B\]"),
    (lambda: K.grpo_advantages(torch.randn(2), torch.tensor([0, 1, 2]), m), "group_ids must have shape"),
    (lambda: K.gae_advantages(x.reshape(-1), x.reshape(-1), m.reshape(-1), cu_seqlens=torch.tensor([0, 4, 3])),
     "cu_seqlens must start at 0, be non-decreasing"),
    (lambda: K.grpo_advantages(torch.randn(2), torch.tensor([0, 1]), m.reshape(-1), cu_seqlens=torch.tensor([0, 3, 9])),
     r"end at most at N = 6"),
    *[(lambda cu=cu, f=f, mode=mode: f(x.reshape(-1), x.reshape(-1), x.reshape(-1), m.reshape(-1),
                                       cu_seqlens=torch.tensor(cu), loss_agg_mode=mode), msg)
      for f in (K.ppo_loss, K.value_loss)
      for cu, msg in (([0, 4, 3], "smallest step -1"), ([1, 3, 6], "start 1"), ([0, 3, 9], "end at most at N = 6"))
      for mode in ("token-mean", "seq-mean-token-mean")],
    (lambda: K.ppo_loss(x, x.to("meta"), x, m), "old_logp must be on logp's device cpu"),
    (lambda: K.fused_linear_logprob(hidden, weight.to("meta"), ids), "weight must be on hidden's device cpu"),
    (lambda: K.gae_advantages(x, x, m.to("meta")), "rewards must be on mask's device"),
]


@pytest.mark.parametrize("call,message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
@pytest.mark.gpu
def test_mismatched_devices():
    with pytest.raises(ValueError, match="old_logp must be on logp's device"):
        K.ppo_loss(x.cuda(), x, x.cuda(), m.cuda())


def test_grpo_eps_must_be_positive_on_both_backends(backend, device):
    """eps = 0 on a group of equal scores divided 0 by 0: NaN advantages, silently (probe 15f)."""
    d = device
    scores, groups, mask = torch.ones(4, device=d), torch.tensor([0, 0, 1, 1], device=d), torch.ones(4, 3, device=d)
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match=r"eps must (lie in \(0.0, inf\]|be a number)"):
            K.grpo_advantages(scores, groups, mask, eps=eps)
    turn_keys, cu_turns = torch.tensor([5, 5, 5, 5], device=d), torch.tensor([0, 1, 2, 3, 4], device=d)
    with pytest.raises(ValueError, match=r"eps must lie in \(0.0, inf\]"):
        K.gigpo_advantages(scores, groups, turn_keys, torch.zeros(4, device=d), cu_turns, torch.arange(4, device=d),
                           torch.ones(4, device=d), eps=0.0)
    adv = K.grpo_advantages(scores, groups, mask, eps=1e-6)  # equal scores: zero advantage, finite
    assert torch.equal(adv, torch.zeros(4, 3, device=d))
    adv, step, _ = K.gigpo_advantages(scores, groups, turn_keys, torch.zeros(4, device=d), cu_turns,
                                      torch.arange(4, device=d), torch.ones(4, device=d))
    assert torch.isfinite(adv).all() and torch.isfinite(step).all()


def test_an_empty_vocab_is_named_as_such():
    """V = 0 was reported as 'ids must lie in [0, 0)' (or a ZeroDivisionError for an empty batch)."""
    def ids(*shape):
        return torch.zeros(shape, dtype=torch.long)

    for call in (lambda: K.selective_logprob(torch.randn(2, 3, 0), ids(2, 3)),
                 lambda: K.selective_logprob(torch.randn(0, 0), ids(0)),
                 lambda: K.fused_linear_logprob(torch.randn(3, 4), torch.randn(0, 4), ids(3)),
                 lambda: K.fused_linear_logprob(torch.randn(0, 4), torch.randn(0, 4), ids(0))):
        with pytest.raises(ValueError, match=r"the vocab is empty \(V = 0"):
            call()


@pytest.mark.parametrize("shape", [(0, 5), (0, 0, 5), (0, 3, 5), (2, 0, 5), (0, 2, 3, 5)])
def test_logprobs_of_an_empty_batch_are_empty_on_both_backends(backend, shape):
    """An empty batch raised torch's 'stack expects a non-empty TensorList' on the torch path (the Triton path
    returned an empty result): both return ids.shape, fp32 (fp64 for fp64 logits), with a zero gradient."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logits = torch.randn(*shape[:-1], shape[-1] + 1, dtype=dtype)[..., :-1].requires_grad_()  # not contiguous
        ids = torch.zeros(shape[:-1], dtype=torch.long)
        out = K.selective_logprob(logits, ids)
        assert out.shape == ids.shape and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        out.sum().backward()
        assert logits.grad.shape == logits.shape
    hidden = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    logp, entropy = K.fused_linear_logprob(hidden, weight, torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert logp.shape == entropy.shape == (0,) and logp.dtype == torch.float32
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 4) and torch.equal(weight.grad, torch.zeros(5, 4))
