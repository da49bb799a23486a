"""selective_logprob and fused_linear_logprob against matmul -> log_softmax -> gather in fp64: values, entropy
and gradients, both backends, fp32 and bf16, odd vocab sizes, temperature != 1, bias, chunk boundaries."""

import pytest
import torch
from _truth import logits_logprob_truth, logprob_truth

import fastpo.kernels as K
from fastpo.kernels import reference as ref

# (dtype, atol for fp32 outputs, rtol/atol for gradients returned in the input dtype)
DTYPES = [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 2e-5, 2e-2)]


def _inputs(n, h, v, dtype, device, bias=True, scale=0.5):
    hidden = torch.randn(n, h, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device=device) * scale).to(dtype).requires_grad_(True)
    b = torch.randn(v, device=device).to(dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, v, (n,), device=device)
    return hidden, weight, b, ids


def _truth_grads(hidden, weight, bias, ids, temperature, g_logp, g_ent):
    tensors = (hidden, weight) + ((bias,) if bias is not None else ())
    leaves = [x.detach().double().requires_grad_(True) for x in tensors]
    logp, ent = logprob_truth(leaves[0], leaves[1], ids, leaves[2] if bias is not None else None, temperature)
    ((logp * g_logp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    return logp, ent, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,atol,gtol", DTYPES)
@pytest.mark.parametrize("vocab,temperature,bias", [(1000, 1.0, False), (1000, 0.7, True), (32001, 1.3, True)])
def test_fused_linear_logprob_matches_truth(fused_backend, device, dtype, atol, gtol, vocab, temperature, bias):
    hidden, weight, b, ids = _inputs(11, 24, vocab, dtype, device, bias)
    logp, ent = K.fused_linear_logprob(hidden, weight, ids, b, temperature, return_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and logp.shape == ids.shape
    g_logp, g_ent = torch.randn(11, device=device), torch.randn(11, device=device)
    t_logp, t_ent, t_grads = _truth_grads(hidden, weight, b, ids, temperature, g_logp, g_ent)
    torch.testing.assert_close(logp.double(), t_logp, atol=atol, rtol=1e-5)
    torch.testing.assert_close(ent.double(), t_ent, atol=atol, rtol=1e-5)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    grads = [hidden.grad, weight.grad] + ([b.grad] if bias else [])
    for got, want in zip(grads, t_grads, strict=True):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=gtol * scale, rtol=gtol)


def test_fused_linear_logprob_batched_shape_and_logp_only_grad(fused_backend, device):
    hidden, weight, _, _ = _inputs(6, 16, 257, torch.float32, device, bias=False)
    hidden3 = hidden.detach().view(2, 3, 16).requires_grad_(True)
    ids = torch.randint(0, 257, (2, 3), device=device)
    logp = K.fused_linear_logprob(hidden3, weight, ids)
    assert logp.shape == (2, 3)
    logp.sum().backward()
    t_logp, _, (t_h, t_w) = _truth_grads(hidden3.reshape(6, 16), weight, None, ids.reshape(6), 1.0,
                                         torch.ones(6), torch.zeros(6))
    torch.testing.assert_close(logp.reshape(6).double(), t_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(hidden3.grad.reshape(6, 16).double(), t_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), t_w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,atol,gtol", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 32001])
def test_selective_logprob_matches_truth(backend, device, dtype, atol, gtol, vocab):
    logits = (torch.randn(3, 6, vocab, device=device) * 3).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (3, 5), device=device)
    logp = K.selective_logprob(logits[:, :-1], ids, temperature=0.8)  # a strided view, read in place
    g = torch.randn(3, 5, device=device)
    (logp * g).sum().backward()
    leaf = logits.detach().double().requires_grad_(True)
    t_logp, _ = logits_logprob_truth(leaf[:, :-1], ids, 0.8)
    (t_logp * g.double()).sum().backward()
    torch.testing.assert_close(logp.double(), t_logp, atol=atol, rtol=1e-5)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), leaf.grad, atol=gtol * 0.1 + 1e-6, rtol=gtol)


def test_selective_logprob_2d_and_4d(backend, device):
    logits = torch.randn(2, 2, 3, 50, device=device)
    ids = torch.randint(0, 50, (2, 2, 3), device=device)
    t_logp, _ = logits_logprob_truth(logits, ids)
    torch.testing.assert_close(K.selective_logprob(logits, ids).double(), t_logp, atol=1e-5, rtol=1e-5)
    flat = K.selective_logprob(logits.reshape(-1, 50), ids.reshape(-1))
    torch.testing.assert_close(flat.double(), t_logp.reshape(-1), atol=1e-5, rtol=1e-5)


def test_vocab_of_one_gives_zero_logp(fused_backend, device):
    hidden, weight, b, ids = _inputs(5, 8, 1, torch.float32, device)
    logp, ent = K.fused_linear_logprob(hidden, weight, ids, b, return_entropy=True)
    assert torch.equal(logp, torch.zeros_like(logp)) or logp.abs().max() < 1e-6
    assert ent.abs().max() < 1e-6


def test_reference_chunks_and_never_builds_full_logits(monkeypatch):
    """Several token chunks x vocab chunks (with ragged ends) agree with the truth, and no matmul output is
    larger than one chunk (the N x V logits are never formed)."""
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 6 * 128)
    monkeypatch.setattr(ref, "VOCAB_CHUNK", 128)
    real_mm, sizes = torch.mm, []

    def spy_mm(a, b, **kw):
        out = real_mm(a, b, **kw)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "mm", spy_mm)
    hidden, weight, b, ids = _inputs(17, 12, 1000, torch.float64, "cpu")
    logp, ent = ref.fused_linear_logprob(hidden, weight, ids, b, 0.9, return_entropy=True)
    g = torch.randn(17, dtype=torch.float64)
    ((logp * g).sum() + ent.sum()).backward()
    t_logp, t_ent, t_grads = _truth_grads(hidden, weight, b, ids, 0.9, g, torch.ones(17))
    torch.testing.assert_close(logp, t_logp)
    torch.testing.assert_close(ent, t_ent)
    for got, want in zip([hidden.grad, weight.grad, b.grad], t_grads, strict=True):
        torch.testing.assert_close(got, want)
    logits_sized = [s for s in sizes if s > 17 * 12]
    assert logits_sized and max(logits_sized) <= 6 * 128, sizes


def _block_allocations(vocab_chunk: int, monkeypatch) -> int:
    """Allocations of at least one logits block made by aten ops called directly from the reference fused logprob
    (forward with entropy + backward), at 3 token chunks of 6 rows x 1000 / vocab_chunk vocab chunks."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 6 * vocab_chunk)
    monkeypatch.setattr(ref, "VOCAB_CHUNK", vocab_chunk)
    hidden, weight, _, ids = _inputs(17, 12, 1000, torch.float64, "cpu", bias=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, ent = ref.fused_linear_logprob(hidden, weight, ids, None, 1.0, return_entropy=True)
        (logp.sum() + ent.sum()).backward()
    smallest_block = 5 * (1000 % vocab_chunk or vocab_chunk) * 8  # the last token chunk x the ragged vocab chunk
    top_level = [e for e in prof.events() if e.name.startswith("aten::")
                 and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    return sum(1 for e in top_level if e.cpu_memory_usage >= smallest_block)


def test_reference_allocates_its_blocks_once_per_call(monkeypatch):
    """The forward and the backward each allocate their two block buffers (logits, exp) once, plus dW: the count
    does not grow with the number of vocab chunks (no fresh exp / product block per chunk)."""
    assert _block_allocations(128, monkeypatch) == _block_allocations(100, monkeypatch) == 5


def test_reference_reads_hidden_in_place_at_temperature_one(monkeypatch):
    """At temperature 1 in the compute dtype the token chunks fed to the GEMMs are views of hidden (no copy); at
    another temperature they are scaled copies."""
    real_mm, firsts = torch.mm, []

    def spy_mm(a, b, **kw):
        firsts.append(a.untyped_storage().data_ptr())
        return real_mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", spy_mm)
    hidden, weight, _, ids = _inputs(17, 12, 100, torch.float32, "cpu", bias=False)
    for temperature, in_place in ((1.0, True), (0.5, False)):
        firsts.clear()
        logp = ref.fused_linear_logprob(hidden, weight, ids, None, temperature)
        logp.sum().backward()
        assert firsts and all((p == hidden.untyped_storage().data_ptr()) == in_place for p in firsts), temperature


@pytest.mark.parametrize("kernel", ["tiled", "persistent-ptr", "persistent-tma"])
def test_triton_backward_chunking(monkeypatch, device, kernel):
    """The Triton backward with token chunks and vocab chunks (GRAD_ELEMENTS small) matches the truth, with the
    tiled and the persistent kernels (the latter with pointer loads and with TMA descriptors)."""
    from fastpo.kernels.ops import flp_persistent
    from fastpo.kernels.ops import logprob as tlp

    monkeypatch.setitem(tlp._CPU, "GRAD_ELEMENTS", 16 * 512)
    monkeypatch.setattr(tlp, "GRAD_ELEMENTS", 64 * 256)
    monkeypatch.setattr(flp_persistent, "GRAD_ELEMENTS", 64 * 256)
    # TMA: forced on under the interpreter (which emulates it), the capability check's choice on a GPU
    tma = False if kernel == "persistent-ptr" else (True if device == "cpu" else None)
    impl, extra = (tlp, {}) if kernel == "tiled" else (flp_persistent, {"tma": tma})
    hidden, weight, b, ids = _inputs(137, 20, 1500, torch.float32, device)
    logp, ent, lse = impl.fused_linear_logprob_fwd(hidden.detach(), weight.detach(), b.detach(), ids, 1.1, True,
                                                   **extra)
    g, ge = torch.randn(137, device=device), torch.randn(137, device=device)
    d_h, d_w, d_b = impl.fused_linear_logprob_bwd(g, ge, None, hidden.detach(), weight.detach(), b.detach(), ids,
                                                  lse, ent, 1.1, **extra)
    _, _, (t_h, t_w, t_b) = _truth_grads(hidden, weight, b, ids, 1.1, g, ge)
    for got, want in zip([d_h, d_w, d_b], [t_h, t_w, t_b], strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_gradcheck_reference_fused_linear_logprob():
    hidden, weight, b, ids = _inputs(4, 5, 9, torch.float64, "cpu")

    def fn(h, w, bb):
        logp, ent = ref.fused_linear_logprob(h, w, ids, bb, temperature=0.7, return_entropy=True)
        return logp, ent

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_gradcheck_fused_linear_logprob_custom_op(monkeypatch):
    monkeypatch.setenv("FASTPO_KERNELS", "torch")
    hidden, weight, b, ids = _inputs(3, 4, 7, torch.float64, "cpu")
    fn = lambda h, w, bb: K.fused_linear_logprob(h, w, ids, bb, 1.6, return_entropy=True)
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    sel_ids = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda x: K.selective_logprob(x, sel_ids, 0.5), (logits,))


@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])
def test_frozen_lm_head_skips_its_gradient(fused_backend, device, monkeypatch, frozen):
    """A weight / bias that needs no gradient gets None, the backward is told to skip dW / db (no 2NVH FLOP for
    a frozen or LoRA head), and the other gradients are bit-identical to the full backward's."""
    from fastpo.kernels.ops import library as lib

    impl = ref if fused_backend == "torch" else lib.triton_module(
        "logprob" if fused_backend == "triton" else "flp_persistent")
    real, calls = impl.fused_linear_logprob_bwd, []
    monkeypatch.setattr(impl, "fused_linear_logprob_bwd", lambda *a, **kw: calls.append(a[-2:]) or real(*a, **kw))
    hidden, weight, b, ids = _inputs(9, 16, 300, torch.float32, device)
    g_logp, g_ent = torch.randn(9, device=device), torch.randn(9, device=device)

    def run(h, w, bb):
        logp, ent = K.fused_linear_logprob(h, w, ids, bb, 0.9, return_entropy=True)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()

    run(hidden, weight, b)
    h2 = hidden.detach().clone().requires_grad_(True)
    w2 = weight.detach().clone().requires_grad_(frozen == "bias")
    b2 = b.detach().clone().requires_grad_(frozen == "weight")
    run(h2, w2, b2)
    assert calls == [(True, True), (frozen == "bias", frozen == "weight")]
    torch.testing.assert_close(h2.grad, hidden.grad, atol=0, rtol=0)
    assert (w2.grad is None) == (frozen != "bias") and (b2.grad is None) == (frozen != "weight")
    if w2.grad is not None:
        torch.testing.assert_close(w2.grad, weight.grad, atol=0, rtol=0)
    if b2.grad is not None:
        torch.testing.assert_close(b2.grad, b.grad, atol=0, rtol=0)


@pytest.mark.gpu
def test_fp32_takes_tf32_tensor_cores_by_default(monkeypatch):
    """CUDA only: fp32 inputs run TF32 dots unless FASTPO_KERNELS_FP32=ieee; both stay within TF32's error of the
    fp64 truth (10-bit mantissa: ~1e-3 relative per product), the exact path within fp32's."""
    hidden, weight, _, ids = _inputs(300, 256, 5000, torch.float32, "cuda", bias=False, scale=0.1)
    t_logp, _ = logprob_truth(hidden.double(), weight.double(), ids)
    out = {}
    for mode in ("tf32", "ieee"):
        monkeypatch.setenv("FASTPO_KERNELS_FP32", mode)
        out[mode] = K.fused_linear_logprob(hidden.detach(), weight.detach(), ids)
    torch.testing.assert_close(out["ieee"].double(), t_logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out["tf32"].double(), t_logp, atol=5e-2, rtol=1e-2)
    assert not torch.equal(out["tf32"], out["ieee"])  # the TF32 path really ran


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["tiled", "persistent", "persistent-ptr"])
def test_fused_linear_logprob_gpu_large(monkeypatch, kernel):
    """CUDA only: a Qwen-like vocab, several vocab splits and grad chunks, bf16, against the CPU reference; once
    per Triton implementation (persistent: TMA on sm_90+)."""
    monkeypatch.setenv("FASTPO_FLP_KERNEL", kernel)
    hidden, weight, _, ids = _inputs(1000, 256, 151936, torch.bfloat16, "cuda", bias=False, scale=0.05)
    logp, ent = K.fused_linear_logprob(hidden, weight, ids, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    h, w = hidden.detach().cpu().float(), weight.detach().cpu().float()
    r_logp, r_ent = ref.fused_linear_logprob(h, w, ids.cpu(), return_entropy=True)
    torch.testing.assert_close(logp.cpu(), r_logp, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ent.cpu(), r_ent, atol=1e-3, rtol=1e-3)
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
