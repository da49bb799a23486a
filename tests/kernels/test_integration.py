"""Custom-op integration: backend dispatch, torch.compile(fullgraph=True), opcheck, torch-only import."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastpo.kernels as K
from fastpo.kernels.ops import library as lib


def _step(hidden, weight, ids, old, mask, rewards, values, scores, groups):
    logp, entropy = K.fused_linear_logprob(hidden, weight, ids, temperature=0.9, return_entropy=True)
    adv, returns = K.gae_advantages(rewards, values, mask, 0.99, 0.95)
    adv = adv + K.grpo_advantages(scores, groups, mask)
    loss, metrics = K.ppo_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean", entropy=entropy,
                               entropy_coef=0.01)
    v_loss, _ = K.value_loss(values, values.detach() + 0.1, returns, mask)
    return loss + v_loss, metrics["clipfrac"], metrics["entropy"], adv


def _step_inputs(device):
    b, t, h, v = 3, 7, 16, 100
    hidden = torch.randn(b, t, h, device=device, requires_grad=True)
    weight = torch.randn(v, h, device=device, requires_grad=True)
    values = torch.randn(b, t, device=device, requires_grad=True)
    return (hidden, weight, torch.randint(0, v, (b, t), device=device), torch.randn(b, t, device=device) - 4,
            torch.rand(b, t, device=device) < 0.7, torch.randn(b, t, device=device), values,
            torch.randn(b, device=device), torch.tensor([0, 0, 1], device=device))


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_torch_compile_fullgraph_matches_eager(monkeypatch, device, backend_name):
    monkeypatch.setenv("FASTPO_KERNELS", backend_name)
    torch._dynamo.reset()
    inputs = _step_inputs(device)
    compiled = torch.compile(_step, fullgraph=True)
    out_c = compiled(*inputs)
    out_c[0].backward()
    grads_c = [x.grad.clone() for x in (inputs[0], inputs[1], inputs[6])]
    for x in (inputs[0], inputs[1], inputs[6]):
        x.grad = None
    out_e = _step(*inputs)
    out_e[0].backward()
    for got, want in zip(out_c, out_e, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for got, x in zip(grads_c, (inputs[0], inputs[1], inputs[6]), strict=True):
        torch.testing.assert_close(got, x.grad, atol=1e-6, rtol=1e-6)


def test_backend_switch_really_switches(monkeypatch, device):
    from fastpo.kernels import reference
    from fastpo.kernels.ops import losses

    calls = []
    real_t, real_r = losses.ppo_loss_fwd, reference.ppo_loss_fwd  # the ops look these up at call time
    monkeypatch.setattr(losses, "ppo_loss_fwd", lambda *a: calls.append("triton") or real_t(*a))
    monkeypatch.setattr(reference, "ppo_loss_fwd", lambda *a: calls.append("torch") or real_r(*a))
    x = torch.randn(2, 3, device=device)
    for name in ("triton", "torch"):
        monkeypatch.setenv("FASTPO_KERNELS", name)
        K.ppo_loss(x, x, x, torch.ones(2, 3, device=device))
    monkeypatch.delenv("FASTPO_KERNELS")
    K.ppo_loss(x, x, x, torch.ones(2, 3, device=device))  # auto: CPU -> torch, CUDA -> triton
    assert calls == ["triton", "torch", "triton" if x.is_cuda else "torch"]


def test_backend_errors(monkeypatch):
    x = torch.randn(2, 3)
    monkeypatch.setenv("FASTPO_KERNELS", "cuda")
    with pytest.raises(ValueError, match="FASTPO_KERNELS"):
        K.ppo_loss(x, x, x, torch.ones(2, 3))
    monkeypatch.setenv("FASTPO_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset on a GPU run
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        K.ppo_loss(x, x, x, torch.ones(2, 3))


def test_opcheck_custom_ops(monkeypatch):
    monkeypatch.setenv("FASTPO_KERNELS", "torch")
    ops = torch.ops.fastpo
    n, h, v = 5, 4, 11
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    bias, ids = torch.randn(v, requires_grad=True), torch.randint(0, v, (n,))
    logits = torch.randn(2, 3, v, requires_grad=True)
    lp, mask, w = torch.randn(2, 4, requires_grad=True), torch.rand(2, 4) < 0.6, torch.full((2, 4), 0.125)
    ent = torch.rand(2, 4, requires_grad=True)
    cases = [
        (ops.fused_linear_logprob.default, (hidden, weight, bias, ids, 0.8, True)),
        (ops.fused_linear_logprob.default, (hidden, weight, None, ids, 1.0, False)),
        (ops.selective_logprob.default, (logits, torch.randint(0, v, (2, 3)), 1.2)),
        (ops.ppo_loss.default, (lp, lp.detach() + 0.1, torch.randn(2, 4), w, mask, lp.detach(), ent, 0.2, 0.28, 3.0,
                                0.1, 1, 0.01, True)),
        (ops.ppo_loss.default, (lp.detach(), lp.detach() + 0.1, torch.randn(2, 4), w, mask, None, None, 0.2, 0.28,
                                3.0, 0.0, 0, 0.0, False)),
        (ops.value_loss.default, (lp, lp.detach() + 0.3, torch.randn(2, 4), w, mask, 0.2, True)),
        (ops.gae_advantages.default, (torch.randn(2, 4), torch.randn(2, 4), mask, None, None, 0.9, 0.9, True)),
        (ops.grpo_advantages.default, (torch.randn(2), torch.tensor([1, 1]), mask, None, True, 1e-6)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_import_needs_only_torch_and_missing_triton_is_reported():
    script = textwrap.dedent("""
        import os, sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        import fastpo.kernels as K
        assert "triton" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
        x = torch.randn(2, 3)
        loss, _ = K.ppo_loss(x, x, x, torch.ones(2, 3))  # CPU -> torch path, fine without triton
        os.environ["FASTPO_KERNELS"] = "triton"
        try:
            K.ppo_loss(x, x, x, torch.ones(2, 3))
        except ImportError as exc:
            assert "FASTPO_KERNELS=torch" in str(exc), exc
            print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("FASTPO_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


def test_ids_out_of_range_raise_before_launch(monkeypatch, backend, device):
    hidden, weight = torch.randn(3, 4, device=device), torch.randn(10, 4, device=device)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\).*\[-1, 3\]"):
        K.fused_linear_logprob(hidden, weight, torch.tensor([0, 3, -1], device=device))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\).*\[0, 10\]"):
        K.selective_logprob(torch.randn(3, 10, device=device), torch.tensor([0, 10, 2], device=device))
    launched = []
    monkeypatch.setattr(lib, "triton_module", lambda name: launched.append(name))
    monkeypatch.setattr(lib.ref, "fused_linear_logprob_fwd", lambda *a: launched.append("torch"))
    with pytest.raises(ValueError):
        K.fused_linear_logprob(hidden, weight, torch.tensor([0, 11, 1], device=device))
    assert launched == []
