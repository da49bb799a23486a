"""fastpo.kernels benchmarks: fused-linear logprob, PPO loss, GAE and GRPO against the baselines users run today.

  python bench/bench_kernels.py                          # CPU targets at Qwen2.5-0.5B shapes (~5-10 min)
  python bench/bench_kernels.py --quick                  # CPU, small shapes (seconds)
  python bench/bench_kernels.py --gpu --tokens 8192,32768   # GPU: triton do_bench vs eager / compile / Liger
  python bench/bench_kernels.py --gpu --dry              # the GPU code path on CPU tensors, tiny shapes

OMP_NUM_THREADS is set to 2 unless the caller sets it (the GAE / GRPO / PPO micro-benchmarks run with one torch
thread on CPU, noted in the config column: on a shared 2-core machine OpenMP barriers make sub-ms ops erratic).
Prints a table and appends rows (bench/common.py columns) to bench/results/kernels.csv, or --results-dir.
Baselines: "naive" = matmul -> log_softmax -> gather; "verl-loop" = verl's multi-turn GAE (a loop over positions,
vectorised over the batch); "ragen-loop" = RAGEN's GAE (a loop over rows and trained positions on tensors);
"list-loop" = the same per-position recursion on Python floats; "dict-loop" = verl's GRPO (a dict walk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
if "--dry" in sys.argv:  # the Triton interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FASTPO_KERNELS", "triton")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_allow_dirty,
    append_rows,
    print_table,
    quantiles,
    require_clean_tree,
    status_kib,
    time_median,
)

import fastpo.kernels as K  # noqa: E402
from fastpo.kernels.ab import kernel_choice  # noqa: E402

HIDDEN, VOCAB = 896, 151_936  # Qwen2.5-0.5B
#: Dense bf16 tensor-core peaks from the vendors' spec sheets (TFLOP/s), by a substring of the device name; a device
#: not listed gets no "% of spec peak" (NaN) rather than a guessed figure.
SPEC_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def spec_peak_tflops(device_name: str) -> float:
    """Dense bf16 peak of the named device (TFLOP/s, first matching substring of SPEC_PEAK_TFLOPS), NaN if unknown."""
    return next((v for k, v in SPEC_PEAK_TFLOPS.items() if k in device_name), float("nan"))


# ------------------------------------------------------------------------------------------------ baselines
def naive_logprob(hidden, weight, ids):
    """What most trainers do: full logits, log_softmax in fp32, gather."""
    return torch.log_softmax((hidden @ weight.t()).float(), dim=-1).gather(-1, ids[:, None]).squeeze(-1)


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's multi-turn GAE: one step per position, vectorised over the batch, then masked whitening."""
    m = mask.float()
    next_value = torch.zeros_like(rewards[:, 0])
    last = torch.zeros_like(next_value)
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = candidate * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / (m.sum() - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8) * m, returns


def ragen_gae_rows(rewards, values, mask, gamma, lam, rows):
    """RAGEN's multi-turn GAE: for each row, a loop over its trained positions on tensor elements."""
    adv = torch.zeros_like(rewards)
    for b in rows:
        valid = mask[b].nonzero(as_tuple=True)[0]
        last = 0.0
        for i in range(len(valid) - 1, -1, -1):
            pos = valid[i]
            next_value = values[b, valid[i + 1]] if i < len(valid) - 1 else 0.0
            delta = rewards[b, pos] + gamma * next_value - values[b, pos]
            last = delta + gamma * lam * last
            adv[b, pos] = last
    return adv


def list_gae_rows(rewards, values, mask, gamma, lam, rows):
    """The per-position recursion (with fastpo's reward crediting) on Python floats, one row at a time."""
    out = []
    for b in rows:
        r, v, m = rewards[b], values[b], mask[b]
        adv = [0.0] * len(r)
        last = next_value = carried = 0.0
        for t in range(len(r) - 1, -1, -1):
            carried += r[t]
            if m[t]:
                last = carried + gamma * next_value - v[t] + gamma * lam * last
                adv[t], next_value, carried = last, v[t], 0.0
        out.append(adv)
    return out


def dict_grpo(scores, index, mask, eps=1e-6):
    """verl's GRPO outcome advantage: a dict of groups, one tensor element at a time."""
    scores = scores.clone()
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for g, vals in groups.items():
        if len(vals) == 1:
            mean[g], std[g] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean[g], std[g] = torch.mean(torch.stack(vals)), torch.std(torch.stack(vals))
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return scores[:, None] * mask


def eager_ppo(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_c=3.0):
    """verl's vanilla policy loss with dual clip, token-mean."""
    ratio = torch.exp((logp - old).clamp(-20, 20))
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(clipped, -adv * clip_c), clipped)
    return (pg * mask).sum() / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------------- inputs
def logprob_inputs(n_tokens, hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen).mul_(0.02).to(device, dtype).requires_grad_(True)
    x = torch.randn(n_tokens, hidden, generator=gen).to(device, dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (n_tokens,), generator=gen).to(device)
    grad = torch.randn(n_tokens, generator=gen).to(device)
    return x, weight, ids, grad


def multi_turn_batch(rows, length, device="cpu", seed=0):
    """A 200-token prompt, then turns: a response block (trained, 50-150 tokens, reward on its last token) and an
    observation block 1.5x as long (untrained): ~40% trained tokens."""
    rng = random.Random(seed)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    rewards = torch.zeros(rows, length)
    for b in range(rows):
        pos = 200
        while pos < length:
            n = rng.randint(50, 150)
            end = min(pos + n, length)
            mask[b, pos:end] = True
            rewards[b, end - 1] = rng.random()
            pos += n + int(1.5 * n)
    values = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed))
    return rewards.to(device), values.to(device), mask.to(device)


def _row(name, provider, mode, metric, unit, x_name, x_value, stats, config):
    p50, p20, p80 = stats
    return dict(name=name, provider=provider, mode=mode, metric=metric, unit=unit, x_name=x_name, x_value=x_value,
                p50=p50, p20=p20, p80=p80, config=config)


# ------------------------------------------------------------------------------------------------ CPU mode
def child_memory(provider: str, n_tokens: int) -> None:
    """Run in a fresh process: one fwd + bwd; print as JSON the RSS before it and the peak RSS during it (bytes).
    The peak is the process's VmHWM, reset after the inputs exist (clear_refs 5); ru_maxrss is not usable
    here since Linux carries it over from the parent across fork + exec."""
    x, weight, ids, grad = logprob_inputs(n_tokens)
    fn = naive_logprob if provider == "naive" else K.fused_linear_logprob
    base = status_kib("VmRSS") * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM also covers the setup, whose peak is the base
    (fn(x, weight, ids) * grad).sum().backward()
    print(json.dumps({"base": base, "peak": status_kib("VmHWM") * 1024}))


def _measure_memory(provider: str, n_tokens: int) -> float:
    cmd = [sys.executable, __file__, "--child-memory", provider, "--tokens", str(n_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return (data["peak"] - data["base"]) / 2**20


def bench_fused_cpu(n_tokens: int, repeats: int, hidden=HIDDEN, vocab=VOCAB, memory=True) -> list[dict]:
    rows = []
    providers = {"naive": naive_logprob, "fastpo": K.fused_linear_logprob}
    if memory:  # first, while this process is small (a child's RSS accounting starts from a fork of it)
        mem = {p: _measure_memory(p, n_tokens) for p in providers}
        mconfig = f"H={hidden} V={vocab} fp32 fwd+bwd peak RSS - RSS after inputs, fresh subprocess per provider"
        rows += [_row("fused_linear_logprob", p, "full", "peak_extra_rss", "MiB", "tokens", n_tokens, (v, v, v),
                      mconfig) for p, v in mem.items()]
        r = mem["fastpo"] / mem["naive"]
        rows.append(_row("fused_linear_logprob", "fastpo/naive", "full", "memory_ratio", "x", "tokens", n_tokens,
                         (r, r, r), mconfig))
    x, weight, ids, grad = logprob_inputs(n_tokens, hidden, vocab)

    def run(fn):
        x.grad = weight.grad = None
        (fn(x, weight, ids) * grad).sum().backward()

    samples = {p: [] for p in providers}
    for rep in range(repeats + 1):  # interleaved; the first round is a warm-up
        for name, fn in providers.items():
            start = time.perf_counter()
            run(fn)
            if rep:
                samples[name].append(time.perf_counter() - start)
    config = f"H={hidden} V={vocab} fp32 fwd+bwd threads={torch.get_num_threads()} repeats={repeats} interleaved"
    rows += [_row("fused_linear_logprob", p, "full", "time", "s", "tokens", n_tokens, quantiles(s), config)
             for p, s in samples.items()]
    ratio = [f / n for f, n in zip(samples["fastpo"], samples["naive"], strict=True)]
    rows.append(_row("fused_linear_logprob", "fastpo/naive", "full", "time_ratio", "x", "tokens", n_tokens,
                     quantiles(ratio), config + " (per-round ratio)"))
    return rows


def bench_gae_cpu(rows: int, length: int, repeats: int, loop_rows: int) -> list[dict]:
    rewards, values, mask = multi_turn_batch(rows, length)
    frac = mask.float().mean().item()
    out = []
    r_list, v_list, m_list = rewards.tolist(), values.tolist(), mask.tolist()
    subset = list(range(loop_rows))
    scale = rows / loop_rows
    for name, gamma, lam in [("gae", 1.0, 1.0), ("gae_discounted", 0.99, 0.95)]:
        base = f"B={rows} T={length} trained={frac:.2f} gamma={gamma} lam={lam} threads=1"
        fast = time_median(lambda g=gamma, lm=lam: K.gae_advantages(rewards, values, mask, g, lm), repeats)
        verl = time_median(lambda g=gamma, lm=lam: verl_gae(rewards, values, mask, g, lm), max(3, repeats // 4))
        lst = time_median(lambda g=gamma, lm=lam: list_gae_rows(r_list, v_list, m_list, g, lm, range(rows)), 3)
        ragen = time_median(lambda g=gamma, lm=lam: ragen_gae_rows(rewards, values, mask, g, lm, subset), 1, 0)
        ragen = tuple(t * scale for t in ragen)
        adv, _ = K.gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
        err = max(abs(a - b) for a, b in zip(adv[0].tolist(), list_gae_rows(r_list, v_list, m_list, gamma, lam,
                                                                          [0])[0], strict=True))
        out.append(_row(name, "fastpo", "forward", "time", "s", "B*T", rows * length, fast,
                        base + f" whiten=True max|A-loop|={err:.1e}"))
        out.append(_row(name, "verl-loop", "forward", "time", "s", "B*T", rows * length, verl, base + " whiten=True"))
        out.append(_row(name, "list-loop", "forward", "time", "s", "B*T", rows * length, lst,
                        base + " no whitening"))
        out.append(_row(name, "ragen-loop", "forward", "time", "s", "B*T", rows * length, ragen,
                        base + f" no whitening; timed on {loop_rows} rows x{scale:g}"))
        for baseline, t in (("verl-loop", verl), ("list-loop", lst), ("ragen-loop", ragen)):
            s = t[0] / fast[0]
            same = " both whitened" if baseline == "verl-loop" else " baseline not whitened"
            out.append(_row(name, f"{baseline}/fastpo", "forward", "speedup", "x", "B*T", rows * length, (s, s, s),
                            base + same + "; ratio of medians"))
    return out


def bench_grpo_cpu(seqs: int, group: int, length: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(seqs, generator=gen)
    group_ids = torch.arange(seqs) // group
    mask = torch.rand(seqs, length, generator=gen) < 0.5
    index = group_ids.tolist()
    config = f"B={seqs} group={group} T={length} threads=1"
    fast = time_median(lambda: K.grpo_advantages(scores, group_ids, mask), repeats)
    loop = time_median(lambda: dict_grpo(scores, index, mask), 3)
    err = (K.grpo_advantages(scores, group_ids, mask) - dict_grpo(scores, index, mask)).abs().max().item()
    s = loop[0] / fast[0]
    return [_row("grpo", "fastpo", "forward", "time", "s", "B", seqs, fast, config + f" max|diff|={err:.1e}"),
            _row("grpo", "dict-loop", "forward", "time", "s", "B", seqs, loop, config),
            _row("grpo", "dict-loop/fastpo", "forward", "speedup", "x", "B", seqs, (s, s, s), config)]


def bench_ppo_cpu(rows: int, length: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(rows, length, generator=gen) - 3).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(rows, length, generator=gen)
    adv = torch.randn(rows, length, generator=gen)
    mask = torch.rand(rows, length, generator=gen) < 0.4

    def run(fn):
        logp.grad = None
        fn().backward()

    config = f"B={rows} T={length} fwd+bwd token-mean threads=1"
    fast = time_median(lambda: run(lambda: K.ppo_loss(logp, old, adv, mask)[0]), repeats)
    eager = time_median(lambda: run(lambda: eager_ppo(logp, old, adv, mask.float())), repeats)
    return [_row("ppo_loss", "fastpo", "full", "time", "s", "tokens", rows * length, fast, config),
            _row("ppo_loss", "eager", "full", "time", "s", "tokens", rows * length, eager, config)]


# ------------------------------------------------------------------------------------------------ GPU mode
def _timer(dry: bool):
    """(fn -> (p50, p20, p80) seconds): triton's do_bench on a GPU, a plain median on CPU (dry runs)."""
    if dry:
        return lambda fn: time_median(fn, repeats=3)
    from triton.testing import do_bench

    return lambda fn: tuple(t / 1e3 for t in do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8]))


def _peak_mib(fn, device) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _liger_loss():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda x, w, ids: -loss(w, x, ids)  # sum of logp (Liger's cross entropy, negated)


class _KernelVariant:
    """``K.fused_linear_logprob`` under one ``FASTPO_FLP_KERNEL`` choice. The choice is read at every forward AND
    backward call, so the benchmark sets it for a provider's whole measurement (``kernel`` attribute), not per call."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def __call__(self, x, weight, ids):
        return K.fused_linear_logprob(x, weight, ids)


def fused_logprob_variants() -> dict[str, object]:
    """The A/B hook of the fused-logprob benchmark: {provider name: fn(x [N, H], weight [V, H], ids [N]) -> logp [N]}
    timed side by side with the baselines. "fastpo" is the shipped default (the tiled kernels); "fastpo-persistent"
    is the persistent kernel (TMA on sm_90+) and "fastpo-persistent-ptr" the same with pointer loads. One GPU run
    times them on the same inputs, and the rows decide the default."""
    return {"fastpo": _KernelVariant("tiled"), "fastpo-persistent": _KernelVariant("persistent"),
            "fastpo-persistent-ptr": _KernelVariant("persistent-ptr")}


def gemm_reference(mode: str, x, weight, grad_logits):
    """The same-shape cuBLAS work a fused logprob cannot beat: the logits GEMM [N, H] x [H, V] (forward), plus the
    two gradient GEMMs dX = G W and dW = G^T X (full) with a ready [N, V] gradient G, all in the inputs' dtype."""
    if mode == "forward":
        return lambda: x @ weight.t()
    return lambda: (x @ weight.t(), grad_logits @ weight, grad_logits.t() @ x)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _gpu_fused(n, providers, hidden, vocab, dtype, device, timer) -> list[dict]:
    """Rows for one token count: time and peak memory of each provider (forward, forward + backward), the cuBLAS
    GEMM reference, each provider's time as % of the GEMM's and its TFLOP/s as % of the device's spec peak. A
    provider that runs out of memory gets a NaN row saying so (the next one still runs)."""
    x, weight, ids, grad = logprob_inputs(n, hidden, vocab, dtype, device)
    flops = {"forward": 2 * n * hidden * vocab, "full": 8 * n * hidden * vocab}
    peak = spec_peak_tflops(torch.cuda.get_device_name(0)) if device == "cuda" else float("nan")
    shape = f"H={hidden} V={vocab} {dtype}"
    rows, gemm_ms = [], {}
    for mode in ("forward", "full"):
        try:
            g = torch.randn(n, vocab, device=device, dtype=dtype) if mode == "full" else None
            t = timer(gemm_reference(mode, x, weight, g))
            del g
            gemm_ms[mode] = t[0] * 1e3
            gemm_flops = 2 * n * hidden * vocab * (1 if mode == "forward" else 3)
            rows.append(_row("fused_linear_logprob", "cublas-gemm", mode, "time", "ms", "tokens", n,
                             tuple(v * 1e3 for v in t), f"{shape} {'1 GEMM' if mode == 'forward' else '3 GEMMs'} "
                             f"{gemm_flops / t[0] / 1e12:.1f} TFLOP/s = {100 * gemm_flops / t[0] / 1e12 / peak:.1f}% "
                             f"of spec peak {peak:g}"))
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            rows.append(_row("fused_linear_logprob", "cublas-gemm", mode, "time", "ms", "tokens", n,
                             (float("nan"),) * 3, f"{shape} out of memory"))
        if device == "cuda":
            torch.cuda.empty_cache()
    for name, fn in providers.items():
        def fwd(fn=fn):
            with torch.no_grad():
                fn(x, weight, ids)

        def full(fn=fn):
            x.grad = weight.grad = None
            (fn(x, weight, ids) * grad).sum().backward()

        choice = kernel_choice(fn.kernel) if isinstance(fn, _KernelVariant) else contextlib.nullcontext()
        with choice:  # set for forward and backward alike
            for mode, work in (("forward", fwd), ("full", full)):
                if name == "liger-flce" and mode == "forward":
                    continue  # Liger computes its gradients inside the forward
                try:
                    t = timer(work)
                    mem = _peak_mib(work, device)
                except RuntimeError as err:
                    if not _is_oom(err):
                        raise
                    x.grad = weight.grad = None
                    rows.append(_row("fused_linear_logprob", name, mode, "time", "ms", "tokens", n, (float("nan"),) * 3,
                                     f"{shape} out of memory"))
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                tflops = flops[mode] / t[0] / 1e12
                ms = t[0] * 1e3
                config = f"{shape} {tflops:.1f} TFLOP/s = {100 * tflops / peak:.1f}% of spec peak {peak:g}"
                rows.append(_row("fused_linear_logprob", name, mode, "time", "ms", "tokens", n,
                                 tuple(v * 1e3 for v in t), config))
                rows.append(_row("fused_linear_logprob", name, mode, "pct_of_gemm", "%", "tokens", n,
                                 (100 * gemm_ms.get(mode, float("nan")) / ms,) * 3,
                                 f"{shape} cuBLAS GEMM time / this time (same shape, {mode})"))
                rows.append(_row("fused_linear_logprob", name, mode, "pct_of_spec_peak", "%", "tokens", n,
                                 (100 * tflops / peak,) * 3,
                                 f"{shape} {flops[mode]:.3g} FLOP / time / {peak:g} TFLOP/s"))
                rows.append(_row("fused_linear_logprob", name, mode, "peak_memory", "MiB", "tokens", n, (mem,) * 3,
                                 f"{shape} max_memory_allocated - allocated before"))
    return rows


def _gpu_small_ops(dry, device, timer) -> list[dict]:
    rows = []
    b, t_len = (4, 64) if dry else (128, 3600)
    logp = (torch.randn(b, t_len, device=device) - 3).requires_grad_(True)
    old, adv = logp.detach() + 0.1, torch.randn(b, t_len, device=device)
    mask = torch.rand(b, t_len, device=device) < 0.4
    compiled_ppo = torch.compile(eager_ppo)
    for name, fn in (("fastpo", lambda: K.ppo_loss(logp, old, adv, mask)[0]),
                     ("eager", lambda: eager_ppo(logp, old, adv, mask.float())),
                     ("compile", lambda: compiled_ppo(logp, old, adv, mask.float()))):
        def full(fn=fn):
            logp.grad = None
            fn().backward()

        rows.append(_row("ppo_loss", name, "full", "time", "ms", "tokens", b * t_len,
                         tuple(v * 1e3 for v in timer(full)), f"B={b} T={t_len} fp32 token-mean"))
        mem = _peak_mib(full, device)
        rows.append(_row("ppo_loss", name, "full", "peak_memory", "MiB", "tokens", b * t_len, (mem,) * 3, ""))
    rewards, values, gmask = multi_turn_batch(b, t_len, device)
    for name, fn in (("fastpo", lambda: K.gae_advantages(rewards, values, gmask, 0.99, 0.95)),
                     ("verl-loop", lambda: verl_gae(rewards, values, gmask, 0.99, 0.95))):
        rows.append(_row("gae", name, "forward", "time", "ms", "B*T", b * t_len, tuple(v * 1e3 for v in timer(fn)),
                         f"B={b} T={t_len} gamma=0.99 lam=0.95"))
        mem = _peak_mib(fn, device)
        rows.append(_row("gae", name, "forward", "peak_memory", "MiB", "B*T", b * t_len, (mem,) * 3, ""))
    seqs = 64 if dry else 4096
    scores = torch.randn(seqs, device=device)
    group_ids = torch.arange(seqs, device=device) // 8
    seq_mask = torch.rand(seqs, 512, device=device) < 0.5
    index = group_ids.tolist()
    for name, fn in (("fastpo", lambda: K.grpo_advantages(scores, group_ids, seq_mask)),
                     ("dict-loop", lambda: dict_grpo(scores, index, seq_mask))):
        t = time_median(fn, 3) if name == "dict-loop" else timer(fn)
        rows.append(_row("grpo", name, "forward", "time", "ms", "B", seqs, tuple(v * 1e3 for v in t),
                         "group=8 T=512"))
    return rows


def bench_gpu(token_counts, dry: bool, emit, sections: frozenset[str] = frozenset({"fused", "small"})) -> None:
    """GPU mode (or its dry run on CPU): fused logprob per token count ("fused"), then PPO / GAE / GRPO ("small");
    ``emit(rows)`` is called after each token count and section, so a timeout keeps what finished."""
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    hidden, vocab = (32, 1000) if dry else (HIDDEN, VOCAB)
    timer = _timer(dry)
    if "fused" in sections:
        # dynamic=True: one compiled graph per mode serves every token count (2 builds instead of 4 in the GPU
        # suite's bench budget); the matmul is cuBLAS either way, the fused softmax + gather Triton
        compiled = torch.compile(naive_logprob, dynamic=True)
        providers = {**fused_logprob_variants(), "eager": naive_logprob, "compile": compiled}
        liger = None if dry else _liger_loss()
        if liger is not None:
            providers["liger-flce"] = liger
        for n in token_counts:
            emit(_gpu_fused(n, providers, hidden, vocab, dtype, device, timer))
            if device == "cuda":
                torch.cuda.empty_cache()
    if "small" in sections:
        emit(_gpu_small_ops(dry, device, timer))


# ---------------------------------------------------------------------------------------------------- main
def gigpo_batch(groups: int, group: int, turns: int, length: int, seed: int = 0) -> list[dict]:
    """Trajectories as the rollout hands them to the trainer: per-token turn_end / loss_mask / rewards arrays of
    `length` tokens split into `turns` turns (the first tokens of each turn are the observation, untrained), and
    per-turn state keys (turn 0 shares the group's initial state; later turns draw from 3 states per group, so
    anchors repeat as in a grid env) and rewards."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for _ in range(group):
            turn_end = np.zeros(length, bool)
            mask = np.zeros(length, bool)
            bounds = sorted(rng.sample(range(1, length - 1), turns - 1)) + [length - 1]
            start = 0
            for end in bounds:
                turn_end[end] = True
                mask[start + (end - start) // 2:end + 1] = True
                start = end + 1
            rewards = np.zeros(length, np.float32)
            rewards[bounds[-1]] = rng.uniform(-1, 1)
            keys = [g * 1000] + [g * 1000 + rng.randrange(1, 4) for _ in range(turns - 1)]
            out.append(dict(turn_end=turn_end, mask=mask, rewards=rewards, score=float(rewards.sum()), group=g,
                            keys=keys, turn_rewards=[rng.uniform(-1, 1) for _ in range(turns)],
                            penalties=[0.0] * turns))
    return out


def bench_gigpo_cpu(groups: int, group: int, turns: int, length: int, repeats: int, iteration_s: float | None,
                    iteration_note: str) -> list[dict]:
    """GiGPO's extra cost per iteration on the trainer's CPU path: everything it adds to GRPO's (the per-turn
    arrays of each trajectory, their concatenation, the token -> turn map, the estimator) minus GRPO's estimator."""
    from fastpo import algorithms as alg
    from fastpo.config import AlgorithmConfig
    from fastpo.rollout import turn_data

    trajs = gigpo_batch(groups, group, turns, length)
    cu = torch.tensor([0, *np.cumsum([length] * len(trajs))], dtype=torch.int64)

    def packed() -> alg.PackedBatch:
        return alg.PackedBatch(
            token_rewards=torch.from_numpy(np.concatenate([t["rewards"] for t in trajs])),
            loss_mask=torch.from_numpy(np.concatenate([t["mask"] for t in trajs])),
            turn_end=torch.from_numpy(np.concatenate([t["turn_end"] for t in trajs])), cu_seqlens=cu,
            scores=torch.tensor([t["score"] for t in trajs]), group_ids=torch.tensor([t["group"] for t in trajs]))

    grpo_cfg, gigpo_cfg = AlgorithmConfig(adv_estimator="grpo"), AlgorithmConfig(adv_estimator="gigpo")
    base = packed()

    def grpo():
        return alg.compute_advantages(base, grpo_cfg)

    def gigpo():
        data = [turn_data(t["turn_end"], t["keys"], t["turn_rewards"], t["penalties"]) for t in trajs]
        base.cu_turns = torch.tensor([0, *np.cumsum([len(k) for k, _ in data])], dtype=torch.int64)
        base.turn_keys = torch.from_numpy(np.concatenate([k for k, _ in data]))
        base.turn_rewards = torch.from_numpy(np.concatenate([r for _, r in data]))
        base.turn_ids = alg.token_turn_ids(base.turn_end, cu, base.cu_turns)
        return alg.compute_advantages(base, gigpo_cfg)

    t_grpo, t_gigpo = time_median(grpo, repeats), time_median(gigpo, repeats)
    n_tok = len(trajs) * length
    shared = base.metrics.get("adv/gigpo_nonsingleton_turn_fraction", 0.0)
    config = (f"{groups} groups x {group} x {turns} turns, {length} tokens each (N={n_tok}), threads=1; gigpo = "
              f"turn_data + concat + token_turn_ids + estimator; nonsingleton turns {shared:.2f}")
    rows = [_row("gigpo_estimator", "grpo", "forward", "time", "ms", "N", n_tok, tuple(v * 1e3 for v in t_grpo),
                 config),
            _row("gigpo_estimator", "gigpo", "forward", "time", "ms", "N", n_tok, tuple(v * 1e3 for v in t_gigpo),
                 config)]
    extra = t_gigpo[0] - t_grpo[0]
    rows.append(_row("gigpo_estimator", "gigpo-grpo", "forward", "extra_time", "ms", "N", n_tok, (extra * 1e3,) * 3,
                     config + "; difference of medians"))
    if iteration_s:
        share = 100 * extra / iteration_s
        rows.append(_row("gigpo_estimator", "gigpo-grpo/iteration", "forward", "share", "%", "N", n_tok,
                         (share,) * 3, config + f"; of a {iteration_s:.3f} s iteration ({iteration_note})"))
    return rows


def tiny_iteration_s() -> tuple[float | None, str]:
    """The newest bench/results/train.csv median iteration time of the tiny preset (1 process), and its source."""
    import csv

    path = Path(__file__).resolve().parent / "results" / "train.csv"
    if not path.exists():
        return None, "no train.csv"
    rows = [r for r in csv.DictReader(path.open()) if r["mode"] == "iteration" and r["x_value"] == "1"
            and "preset=tiny env=preset" in r["config"]]
    if not rows:
        return None, "no tiny iteration row"
    r = rows[-1]
    return float(r["p50"]), f"bench/results/train.csv tiny iteration of {r['timestamp']} at {r['commit']}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="GPU benchmarks (triton do_bench)")
    ap.add_argument("--dry", action="store_true", help="with --gpu: run the GPU code path on CPU, tiny shapes")
    ap.add_argument("--quick", action="store_true", help="CPU: small shapes")
    ap.add_argument("--tokens", default=None, help="fused logprob token counts, comma separated")
    ap.add_argument("--repeats", type=int, default=4, help="CPU fused logprob repeats (interleaved)")
    ap.add_argument("--only", default=None,
                    help="sections: CPU fused,gae,grpo,ppo,gigpo (default all); --gpu fused,small (default both)")
    ap.add_argument("--results-dir", default=None, help="where kernels.csv goes (default bench/results)")
    ap.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    add_allow_dirty(ap)
    args = ap.parse_args(argv)
    if args.child_memory:
        child_memory(args.child_memory, int(args.tokens))
        return
    require_clean_tree(args.allow_dirty)
    if args.gpu:
        tokens = [int(t) for t in (args.tokens or ("64" if args.dry else "8192,32768")).split(",")]

        def emit(rows):
            print_table(rows)
            print(f"appended {len(rows)} rows to {append_rows('kernels', rows, args.results_dir)}", flush=True)

        sections = frozenset((args.only or "fused,small").split(","))
        if not sections <= {"fused", "small"}:
            raise SystemExit(f"--only with --gpu takes fused and/or small, got {args.only!r}")
        bench_gpu(tokens, args.dry, emit, sections)
        return
    only = set((args.only or "fused,gae,grpo,ppo,gigpo").split(","))
    rows = []
    if "fused" in only:
        n = int(args.tokens or (256 if args.quick else 4096))
        shape = dict(hidden=128, vocab=8192) if args.quick else {}
        rows += bench_fused_cpu(n, 2 if args.quick else args.repeats, memory=not args.quick, **shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if "gae" in only:
        rows += bench_gae_cpu(16, 600, 5, 4) if args.quick else bench_gae_cpu(128, 3600, 21, 8)
    if "grpo" in only:
        rows += bench_grpo_cpu(512, 8, 128, 5) if args.quick else bench_grpo_cpu(4096, 8, 512, 21)
        if not args.quick:
            rows += bench_grpo_cpu(128, 16, 3600, 21)
    if "ppo" in only:
        rows += bench_ppo_cpu(8, 512, 5) if args.quick else bench_ppo_cpu(128, 3600, 11)
    if "gigpo" in only:
        it, note = tiny_iteration_s()
        rows += bench_gigpo_cpu(16, 8, 5, 430, 5 if args.quick else 21, it, note)  # tiny preset: 55k tokens
        if not args.quick:
            rows += bench_gigpo_cpu(16, 8, 5, 3000, 11, it, note)  # 16 x 8 x 5 turns of 3k-token trajectories
    torch.set_num_threads(threads)
    print_table(rows)
    path = append_rows("kernels", rows, args.results_dir)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
