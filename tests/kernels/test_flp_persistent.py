"""The persistent fused-logprob kernels (ops/flp_persistent.py) against the tiled ones and the fp64 truth, under
the interpreter: bitwise agreement with the tiled kernels at equal vocab splits (both run the same tile helpers in
the same order), several vocab splits and programs that each loop over several work items, ragged N / V / H, an
empty batch, TMA descriptors (emulated by the interpreter) and pointer loads, and the selection switches. The
truth matrix over dtypes, temperatures, bias and entropy runs through ``fused_backend`` in test_logprob.py."""

import os

import pytest
import torch
from _truth import logprob_truth

import fastpo.kernels as K
from fastpo.kernels.ops import flp_persistent as P
from fastpo.kernels.ops import library as lib
from fastpo.kernels.ops import logprob as L

#: Tests that launch the kernels on CPU tensors: the interpreter runs them; a GPU run (TRITON_INTERPRET unset, compiled
#: kernels) cannot read CPU memory, and test_tma_choice_on_cuda compares the two kernel families there.
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="launches kernels on CPU tensors: Triton interpreter only")


def _inputs(n, h, v, dtype=torch.float32, bias=True):
    hidden = torch.randn(n, h).to(dtype)
    weight = (torch.randn(v, h) * 0.5).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,))


# (N, H, V): N not a multiple of the interpreter's BLOCK_N (16), V not one of BLOCK_V (512), H not one of BLOCK_K
# (32); one exact tile; a vocab of one token; rows of 280 bytes (no TMA: descriptors need 16-byte rows)
SHAPES = [(37, 40, 1500), (16, 32, 512), (5, 8, 1), (50, 72, 1030), (18, 70, 600)]


@interpreter_only
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("programs", [None, 1, 3])
@pytest.mark.parametrize("n,h,v", SHAPES)
def test_bitwise_equal_to_the_tiled_kernels(tma, programs, n, h, v):
    if tma and h * 4 % 16:
        pytest.skip("TMA descriptors need 16-byte rows; tma_supported sends such an H to pointer loads")
    hidden, weight, b, ids = _inputs(n, h, v, bias=v != 512)
    want = L.fused_linear_logprob_fwd(hidden, weight, b, ids, 0.9, True)
    got = P.fused_linear_logprob_fwd(hidden, weight, b, ids, 0.9, True, tma=tma, programs=programs)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    g, g_ent = torch.randn(n), torch.randn(n)
    want = L.fused_linear_logprob_bwd(g, g_ent, None, hidden, weight, b, ids, want[2], want[1], 0.9)
    got = P.fused_linear_logprob_bwd(g, g_ent, None, hidden, weight, b, ids, got[2], got[1], 0.9, tma=tma,
                                     programs=programs)
    for x, y in zip(got, want, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


@interpreter_only
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype,atol,gtol", [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 2e-5, 2e-2)])
def test_vocab_splits_and_work_loop_match_truth(monkeypatch, tma, dtype, atol, gtol):
    """Pretending 8 resident slots gives several vocab splits (their partials combined on the host) and programs
    that loop over several (token block, split) items; 5 programs for the grad loop over several tiles."""
    monkeypatch.setattr(P, "_slots", lambda *a: 8)
    monkeypatch.setattr(L, "_slots", lambda *a: 8)
    n, h, v = 45, 24, 2100
    hidden, weight, b, ids = _inputs(n, h, v, dtype)
    logp, ent, lse = P.fused_linear_logprob_fwd(hidden, weight, b, ids, 1.2, True, tma=tma, programs=5)
    tiled = L.fused_linear_logprob_fwd(hidden, weight, b, ids, 1.2, True)
    for x, y in zip((logp, ent, lse), tiled, strict=True):  # same splits: the same sums
        assert torch.equal(x, y)
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight, b)]
    t_logp, t_ent = logprob_truth(leaves[0], leaves[1], ids, leaves[2], 1.2)
    torch.testing.assert_close(logp.double(), t_logp, atol=atol, rtol=1e-5)
    torch.testing.assert_close(ent.double(), t_ent, atol=atol, rtol=1e-5)
    g, g_ent = torch.randn(n), torch.randn(n)
    ((t_logp * g.double()).sum() + (t_ent * g_ent.double()).sum()).backward()
    grads = P.fused_linear_logprob_bwd(g, g_ent, None, hidden, weight, b, ids, lse, ent, 1.2, tma=tma, programs=5)
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.dtype == dtype
        scale = leaf.grad.abs().max().item()
        torch.testing.assert_close(got.double(), leaf.grad, atol=gtol * scale, rtol=gtol)


@pytest.mark.parametrize("tma", [False, True])
def test_an_empty_batch_launches_nothing(tma):
    hidden, weight, b, ids = _inputs(0, 16, 300)
    logp, ent, lse = P.fused_linear_logprob_fwd(hidden, weight, b, ids, 1.0, True, tma=tma)
    assert logp.shape == ent.shape == lse.shape == (0,)
    d_h, d_w, d_b = P.fused_linear_logprob_bwd(torch.zeros(0), None, None, hidden, weight, b, ids, lse, ent, 1.0,
                                               tma=tma)
    assert d_h.shape == (0, 16) and torch.equal(d_w, torch.zeros_like(weight)) and torch.equal(d_b, torch.zeros(300))


@interpreter_only
def test_logp_only_and_no_weight_gradient():
    hidden, weight, _, ids = _inputs(20, 16, 700, bias=False)
    logp, ent, lse = P.fused_linear_logprob_fwd(hidden, weight, None, ids, 1.0, False, tma=True, programs=2)
    assert ent.numel() == 0
    g = torch.randn(20)
    d_h, d_w, d_b = P.fused_linear_logprob_bwd(g, ent, None, hidden, weight, None, ids, lse, ent, 1.0,
                                               need_weight=False, tma=False, programs=2)
    assert d_w is None and d_b is None
    want = L.fused_linear_logprob_bwd(g, ent, None, hidden, weight, None, ids, lse, ent, 1.0, need_weight=False)[0]
    assert torch.equal(d_h, want)


def test_selection_switch(monkeypatch, device):
    monkeypatch.delenv("FASTPO_FLP_KERNEL", raising=False)
    assert lib.flp_kernel() == "tiled"
    monkeypatch.setenv("FASTPO_KERNELS", "triton")
    hidden = torch.zeros(2, 8, device=device)
    assert lib._flp_impl(hidden) == (L, {})
    monkeypatch.setenv("FASTPO_FLP_KERNEL", "Persistent")
    assert lib._flp_impl(hidden) == (P, {})
    monkeypatch.setenv("FASTPO_FLP_KERNEL", "persistent-ptr")
    assert lib._flp_impl(hidden) == (P, {"tma": False})
    monkeypatch.setenv("FASTPO_KERNELS", "torch")
    assert lib._flp_impl(hidden)[0] is lib.ref
    monkeypatch.setenv("FASTPO_FLP_KERNEL", "warp")
    with pytest.raises(ValueError, match=r"FASTPO_FLP_KERNEL must be one of \('tiled', 'persistent', "
                                         r"'persistent-ptr'\).*'warp'"):
        K.fused_linear_logprob(hidden, torch.zeros(3, 8, device=device),
                               torch.zeros(2, dtype=torch.long, device=device))


def test_tma_is_never_picked_for_cpu_tensors_and_programs_must_be_positive():
    hidden, weight, _, ids = _inputs(4, 16, 50, bias=False)
    assert not P.tma_supported(hidden, weight)
    with pytest.raises(ValueError, match="programs must be >= 1.*got 0"):
        P.fused_linear_logprob_fwd(hidden, weight, None, ids, 1.0, False, programs=0)


def test_gpu_configs():
    for mode, tiles in P.GPU_TILES.items():
        for kind in ("fwd", "grad"):
            cfg = P.gpu_config(kind, mode)
            assert cfg["BLOCK_N"] == tiles["BLOCK_N"] and cfg["PREC"] == ("ieee" if mode == "ieee" else "tf32")
            assert cfg["DOT_F32"] == (mode == "ieee")
    with pytest.raises(ValueError, match="kind must be"):
        P.gpu_config("bwd", "half")


@interpreter_only
def test_ab_logprob_rows_on_the_interpreter():
    """The GPU suite's A/B entry point at a tiny shape on CPU: one row per kernel, same results (bitwise under the
    interpreter), the switches restored afterwards; bad arguments name themselves."""
    import os

    from fastpo.kernels.ab import ab_logprob, main

    before = os.environ.get("FASTPO_FLP_KERNEL")
    rows = ab_logprob(40, 32, 700, "fp32", "cpu", kernels=list(lib.FLP_KERNELS), iters=1, warmup=0)
    assert [r["kernel"] for r in rows] == list(lib.FLP_KERNELS)
    assert os.environ.get("FASTPO_FLP_KERNEL") == before
    for r in rows:
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["peak_mib"] is None
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0
        assert r["max_abs_diff_logp"] == r["max_rel_diff_d_hidden"] == r["max_rel_diff_d_weight"] == 0.0
    with pytest.raises(ValueError, match=r"kernels must be a non-empty list of .*\['fast'\]"):
        ab_logprob(4, 8, 10, device="cpu", kernels=["fast"])
    with pytest.raises(ValueError, match="vocab must be an int >= 1, got 0"):
        ab_logprob(4, 8, 0, device="cpu")
    assert main(["--tokens", "3", "--hidden", "8", "--vocab", "20", "--dtype", "fp32", "--device", "cpu",
                 "--iters", "1", "--no-backward"]) == 0


@pytest.mark.gpu
def test_tma_choice_on_cuda():
    """CUDA only: descriptors on sm_90+ with a Triton that has them, for 16-byte rows; pointers for 40-byte rows
    and on sm_80; both paths agree with the tiled kernels."""
    import triton.language as tl

    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.randint(0, 5000, (300,), device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9 and hasattr(tl, "make_tensor_descriptor")
    assert P.tma_supported(x, w) == hopper
    assert not P.tma_supported(x[:, :20].contiguous(), w[:, :20].contiguous())
    want = L.fused_linear_logprob_fwd(x, w, None, ids, 1.0, True)
    for tma in ((False, True) if hopper else (False,)):
        got = P.fused_linear_logprob_fwd(x, w, None, ids, 1.0, True, tma=tma)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
