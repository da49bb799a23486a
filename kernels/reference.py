"""Plain-torch implementations of every fastpo kernel: the test oracle and the CPU path.

Everything here is vectorised torch (no Python loop over tokens, positions or groups) and accumulates in fp32
(fp64 for fp64 inputs, and for the bi-level scan) whatever the input dtype. The logprob functions are chunked so
that no N x V logits tensor is ever held, only (token chunk) x (vocab chunk) blocks of ``CHUNK_ELEMENTS``; they
come as ``*_fwd`` / ``*_bwd`` pairs (what the custom ops in ``ops/library.py`` call on CPU tensors) plus an
autograd wrapper of the same name without suffix. The losses return their per-token derivative from the forward
(they are weighted token sums), so they need no backward function.

Layouts: token tensors are padded ``[B, T]`` or packed ``[N]`` with ``cu_seqlens`` (int, ``[B + 1]``,
``cu_seqlens[0] == 0``, sequence ``b`` owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Elements of one fp32 logits block (token chunk x vocab chunk) in the chunked logprob code: 2**24 = 64 MiB.
CHUNK_ELEMENTS = 1 << 24
# Vocab chunk of the fused linear logprob: big enough for efficient GEMMs, small enough to stay in memory bounds.
VOCAB_CHUNK = 4096
# PPO log-ratio clamp (as verl): exp() of a larger log-ratio overflows the loss and carries no useful gradient.
LOG_RATIO_CLAMP = 20.0
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation and output dtype of the differentiable functions: fp64 for fp64 inputs (gradcheck), else fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------- logprob
def selective_logprob_fwd(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """log softmax(logits / temperature)[ids]. logits ``[R, V]`` (any float dtype, rows may be strided),
    ids ``[R]`` int. Returns (logp fp32 [R], lse fp32 [R]) where lse = logsumexp(logits / temperature)."""
    rows, vocab = logits.shape
    cd = compute_dtype(logits)
    logp = torch.empty(rows, dtype=cd, device=logits.device)
    lse = torch.empty_like(logp)
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for r0 in range(0, rows, step):
        z = logits[r0 : r0 + step].to(cd) / temperature
        lse[r0 : r0 + step] = torch.logsumexp(z, dim=-1)
        logp[r0 : r0 + step] = z.gather(1, ids[r0 : r0 + step, None].long()).squeeze(1) - lse[r0 : r0 + step]
    return logp, lse


def selective_logprob_bwd(grad_logp: Tensor | None, grad_lse: Tensor | None, logits: Tensor, ids: Tensor, lse: Tensor,
                          temperature: float) -> torch.Tensor:
    """Gradient of (logp, lse) w.r.t. logits: (g_logp * onehot - (g_logp - g_lse) * softmax) / temperature,
    in logits' dtype and shape. grad_lse may be None."""
    rows, vocab = logits.shape
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    cd = compute_dtype(logits)
    g = grad_logp.to(cd)
    coef = -(g - grad_lse.to(cd)) if grad_lse is not None else -g
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for r0 in range(0, rows, step):
        sl = slice(r0, r0 + step)
        p = (logits[sl].to(cd) / temperature).sub_(lse[sl, None]).exp_()
        p.mul_(coef[sl, None]).scatter_add_(1, ids[sl, None].long(), g[sl, None])
        out[sl] = p.div_(temperature)
    return out


class _SelectiveLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
        logp, lse = selective_logprob_fwd(logits, ids, temperature)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor) -> tuple[Tensor, None, None]:
        logits, ids, lse = ctx.saved_tensors
        return selective_logprob_bwd(grad_logp, None, logits, ids, lse, ctx.temperature), None, None


def selective_logprob(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Autograd version of :func:`selective_logprob_fwd` for ``logits [..., V]``, ``ids [...]`` -> fp32 ``[...]``."""
    shape = ids.shape
    return _SelectiveLogprob.apply(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), temperature).view(shape)


def _scaled_rows(hidden: Tensor, n0: int, rows: int, cd: torch.dtype, inv_t: float) -> Tensor:
    """hidden[n0 : n0 + rows] in the compute dtype, divided by the temperature: a view of hidden (no copy) when
    it already has that dtype and the temperature is 1 (x * 1.0 == x exactly, so the results are the same)."""
    xs = hidden[n0 : n0 + rows].to(cd)
    return xs if inv_t == 1.0 else xs * inv_t


def _chunk_sizes(n_tokens: int, vocab: int) -> tuple[int, int]:
    vocab_chunk = min(vocab, VOCAB_CHUNK)
    token_chunk = max(1, min(n_tokens, CHUNK_ELEMENTS // vocab_chunk))
    return token_chunk, vocab_chunk


def fused_linear_logprob_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, temperature: float,
                             return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """logp of ``ids`` under softmax((hidden @ weight.T + bias) / temperature), never forming N x V logits.

    hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, ids ``[N]``. Token chunks x vocab chunks with an
    online log-sum-exp over the vocab. Returns fp32 (logp [N], entropy [N] or [0], lse [N])."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    inv_t = 1.0 / temperature
    cd = compute_dtype(hidden)
    logp = torch.empty(n_tokens, dtype=cd, device=dev)
    lse = torch.empty_like(logp)
    entropy = torch.empty(n_tokens if return_entropy else 0, dtype=cd, device=dev)
    tc, vc = _chunk_sizes(n_tokens, vocab)
    buf = torch.empty(tc * vc, dtype=cd, device=dev)
    # exp of the block for the entropy sum: one second block for the whole call, not a fresh one per vocab chunk
    pbuf = torch.empty(tc * vc if return_entropy else 0, dtype=cd, device=dev)
    ids = ids.long()
    for n0 in range(0, n_tokens, tc):
        xs = _scaled_rows(hidden, n0, tc, cd, inv_t)
        rows = xs.shape[0]
        idc = ids[n0 : n0 + tc]
        m = torch.full((rows,), -math.inf, dtype=cd, device=dev)
        s = torch.zeros(rows, dtype=cd, device=dev)
        t_rel = torch.zeros(rows, dtype=cd, device=dev)  # sum exp(z - m) * (z - m): entropy acc. relative to m
        tgt = torch.zeros(rows, dtype=cd, device=dev)
        for v0 in range(0, vocab, vc):
            wv = weight[v0 : v0 + vc].to(cd)
            z = torch.mm(xs, wv.t(), out=buf[: rows * wv.shape[0]].view(rows, wv.shape[0]))
            if bias is not None:
                z.add_(bias[v0 : v0 + vc].to(cd), alpha=inv_t)
            sel = (idc >= v0) & (idc < v0 + wv.shape[0])
            tgt += torch.where(sel, z.gather(1, (idc - v0).clamp(0, wv.shape[0] - 1)[:, None]).squeeze(1), 0.0)
            m_new = torch.maximum(m, z.amax(1))
            alpha = torch.exp(m - m_new)
            z.sub_(m_new[:, None])
            if return_entropy:
                p = torch.exp(z, out=pbuf[: z.numel()].view(z.shape))
                shift = torch.where(torch.isinf(m), 0.0, m - m_new)
                p_sum = p.sum(1)
                # sum p * (z - m) in place in p's block (vecdot would allocate a third block per vocab chunk)
                t_rel = alpha * (t_rel + shift * s) + p.mul_(z).sum(1)
                s = s * alpha + p_sum
            else:
                s = s * alpha + z.exp_().sum(1)
            m = m_new
        lse[n0 : n0 + rows] = m + torch.log(s)
        logp[n0 : n0 + rows] = tgt - lse[n0 : n0 + rows]
        if return_entropy:
            entropy[n0 : n0 + rows] = torch.log(s) - t_rel / s
    return logp, entropy, lse


def fused_linear_logprob_bwd(grad_logp: Tensor | None, grad_entropy: Tensor | None, grad_lse: Tensor | None,
                             hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, lse: Tensor,
                             entropy: Tensor, temperature: float, need_weight: bool = True,
                             need_bias: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backward of :func:`fused_linear_logprob_fwd`: recomputes each logits block from hidden and weight.

    dL/dz = g_logp * onehot + p * (-(g_logp - g_lse) - g_ent * (log p + entropy)), z = logits / temperature.
    Any grad may be None. Returns (grad_hidden, grad_weight, grad_bias or None) in the input dtypes; the
    accumulation is fp32. need_weight / need_bias False skip dW / db (returned as None): a frozen lm-head."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    inv_t = 1.0 / temperature
    cd = compute_dtype(hidden)
    g = grad_logp.to(cd) if grad_logp is not None else torch.zeros(n_tokens, dtype=cd, device=dev)
    coef = -g if grad_lse is None else grad_lse.to(cd) - g
    g_ent = grad_entropy.to(cd) if grad_entropy is not None and grad_entropy.numel() else None
    d_hidden = torch.zeros(hidden.shape, dtype=cd, device=dev)
    d_weight = torch.zeros(weight.shape, dtype=cd, device=dev) if need_weight else None
    d_bias = torch.zeros(vocab, dtype=cd, device=dev) if bias is not None and need_bias else None
    tc, vc = _chunk_sizes(n_tokens, vocab)
    buf = torch.empty(tc * vc, dtype=cd, device=dev)
    pbuf = torch.empty(tc * vc if g_ent is not None else 0, dtype=cd, device=dev)  # as in the forward
    ids = ids.long()
    for n0 in range(0, n_tokens, tc):
        xs = _scaled_rows(hidden, n0, tc, cd, inv_t)
        rows = xs.shape[0]
        idc, gc, cc, lc = ids[n0 : n0 + tc], g[n0 : n0 + tc], coef[n0 : n0 + tc], lse[n0 : n0 + tc]
        for v0 in range(0, vocab, vc):
            wv = weight[v0 : v0 + vc].to(cd)
            width = wv.shape[0]
            z = torch.mm(xs, wv.t(), out=buf[: rows * width].view(rows, width))
            if bias is not None:
                z.add_(bias[v0 : v0 + vc].to(cd), alpha=inv_t)
            z.sub_(lc[:, None])  # log p
            if g_ent is not None:
                p = torch.exp(z, out=pbuf[: z.numel()].view(z.shape))
                ge = g_ent[n0 : n0 + tc, None]
                z.add_(entropy[n0 : n0 + tc, None]).mul_(-ge).add_(cc[:, None]).mul_(p)
            else:
                z.exp_().mul_(cc[:, None])
            hit = ((idc >= v0) & (idc < v0 + width)).nonzero().squeeze(1)
            z.index_put_((hit, idc[hit] - v0), gc[hit], accumulate=True)
            d_hidden[n0 : n0 + rows].addmm_(z, wv)
            if d_weight is not None:
                d_weight[v0 : v0 + width].addmm_(z.t(), xs)
            if d_bias is not None:
                d_bias[v0 : v0 + width] += z.sum(0)
    d_hidden.mul_(inv_t)
    if d_bias is not None:
        d_bias = d_bias.mul_(inv_t).to(bias.dtype)
    return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype) if d_weight is not None else None, d_bias


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, temperature: float,
                return_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
        logp, entropy, lse = fused_linear_logprob_fwd(hidden, weight, bias, ids, temperature, return_entropy)
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, grad_entropy: Tensor, _grad_lse: Tensor) -> tuple:
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        dh, dw, db = fused_linear_logprob_bwd(
            grad_logp, grad_entropy, None, hidden, weight, bias, ids, lse, entropy, ctx.temperature,
            ctx.needs_input_grad[1], ctx.needs_input_grad[2],
        )
        return dh, dw, db, None, None, None


def fused_linear_logprob(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None = None,
                         temperature: float = 1.0, return_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Autograd version of :func:`fused_linear_logprob_fwd`; hidden ``[..., H]``, ids ``[...]`` -> fp32 ``[...]``
    (and entropy ``[...]`` when return_entropy)."""
    shape = ids.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy, _ = _FusedLinearLogprob.apply(h2, weight, bias, ids.reshape(-1), temperature, return_entropy)
    return (logp.view(shape), entropy.view(shape)) if return_entropy else logp.view(shape)


# ------------------------------------------------------------------------------------------------------ losses
def sequence_index(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Sequence id of every packed token, ``[N]`` int64 (tokens past cu_seqlens[-1] get id B)."""
    pos = torch.arange(n_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), pos, right=True)


def aggregation_weights(mask: Tensor, loss_agg_mode: str, cu_seqlens: Tensor | None = None,
                        norm_len: float | None = None) -> torch.Tensor:
    """Per-token weights w (fp32, mask's shape) such that agg(x) = sum(w * x) for a loss_agg_mode:

    token-mean: 1 / n_masked; seq-mean-token-sum: 1 / B; seq-mean-token-mean: 1 / (B * n_masked_in_seq);
    seq-mean-token-sum-norm (verl / Dr. GRPO): 1 / norm_len, norm_len defaulting to T (padded) or the longest
    sequence (packed). Counts are clamped to >= 1, so an empty row or a fully masked batch weighs 0.
    Padded mask ``[B, T]``, or packed ``[N]`` with ``cu_seqlens``. No host sync."""
    m = (mask != 0).float()
    if loss_agg_mode == "token-mean":
        return m / m.sum().clamp(min=1.0)
    packed = mask.dim() == 1
    if packed:
        if cu_seqlens is None:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r} on a packed [N] mask needs cu_seqlens")
        n_seq = cu_seqlens.shape[0] - 1
        seq = sequence_index(cu_seqlens, m.shape[0]).clamp(max=max(n_seq - 1, 0))
    else:
        n_seq = m.shape[0]
    if loss_agg_mode == "seq-mean-token-sum":
        return m / max(n_seq, 1)
    if loss_agg_mode == "seq-mean-token-mean":
        if packed:
            lens = torch.zeros(max(n_seq, 1), device=m.device).index_add_(0, seq, m)
            return m / (lens.clamp(min=1.0)[seq] * max(n_seq, 1))
        return m / (m.sum(1, keepdim=True).clamp(min=1.0) * max(n_seq, 1))
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_len is None:
            norm_len = (cu_seqlens[1:] - cu_seqlens[:-1]).max().clamp(min=1).float() if packed else m.shape[-1]
        return m / norm_len
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def ppo_loss_fwd(logp: Tensor, old_logp: Tensor, advantages: Tensor, weights: Tensor, mask: Tensor,
                 ref_logp: Tensor | None, entropy: Tensor | None, eps_low: float, eps_high: float, clip_c: float,
                 kl_coef: float, kl_type: int, entropy_coef: float, need_grad: bool = True,
                 is_weight: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted PPO loss sum(w * (c * pg + kl_coef * kl - entropy_coef * entropy)), w from
    :func:`aggregation_weights`, c the off-policy correction ``is_weight`` (logp's shape, detached; None = 1).

    Per token pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), then min(pg, -A clip_c) where A < 0;
    r = exp(clamp(logp - old_logp, +-20)); kl = logp - ref (kl_type 0, k1) or exp(ref - logp) - (ref - logp) - 1
    (1, k3). A clip branch is taken only strictly beyond its bound (so the gradient at a bound is the
    unclipped one). Masked tokens are zeroed right away (NaN / inf there cannot leak). All token tensors share
    one shape. Returns (loss [] in compute_dtype(logp), stats fp32 [6] = [n_clipped, n_dual_clipped,
    sum(old_logp - logp), sum(entropy), sum(kl), n_masked] over masked tokens, dloss/dlogp of logp's shape in
    compute_dtype, or [0] when not need_grad). The gradient is linear in the loss's grad, so the backward is
    a scale of it (and dloss/dentropy = -entropy_coef * w). c scales only the clipped term and its gradient; the
    clip statistics ignore it."""
    m = mask != 0
    cd = compute_dtype(logp)
    zero = torch.zeros((), dtype=cd, device=logp.device)
    lp = torch.where(m, logp.to(cd), zero)
    raw = lp - torch.where(m, old_logp.to(cd), zero)
    adv = torch.where(m, advantages.to(cd), zero)
    ratio = torch.exp(raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = pg2 > pg1
    pg = torch.where(clipped, pg2, pg1)
    neg = adv < 0
    pg3 = torch.where(neg, torch.where(neg, -adv, 1.0) * clip_c, zero)  # no 0 * inf, even in discarded lanes
    dual = neg & (pg > pg3)
    per_token = torch.where(dual, pg3, pg)
    w = torch.where(m, weights.to(cd), zero)
    d = torch.where(clipped | dual | (raw.abs() > LOG_RATIO_CLAMP), zero, pg1) if need_grad else None
    if is_weight is not None:  # not applied when None: the uncorrected loss stays bit for bit what it was
        c = torch.where(m, is_weight.to(cd), zero)
        per_token = c * per_token
        d = c * d if need_grad else None
    kl = None
    if ref_logp is not None:
        ref = torch.where(m, ref_logp.to(cd), zero)
        kl = raw_kl = lp - ref
        if kl_type == 1:
            back = torch.exp(-raw_kl)
            kl = back + raw_kl - 1.0
            if need_grad:
                d = d + kl_coef * (1.0 - back)
        elif need_grad:
            d = d + kl_coef
        per_token = per_token + kl_coef * kl
    ent = None
    if entropy is not None:
        ent = torch.where(m, entropy.to(cd), zero)
        per_token = per_token - entropy_coef * ent
    loss = (w * per_token).sum()
    stats = [clipped & m, dual & m, -raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * m, ent, kl, m]
    stats = torch.stack([x.sum().float() if x is not None else torch.zeros((), device=logp.device) for x in stats])
    d_logp = w * d if need_grad else torch.empty(0, dtype=cd, device=logp.device)
    return loss, stats, d_logp


def value_loss_fwd(values: Tensor, old_values: Tensor, returns: Tensor, weights: Tensor, mask: Tensor, clip: float,
                   need_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """0.5 * sum(w * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)); the clipped branch is taken only
    when strictly larger. Returns (loss [] in compute_dtype(values), stats fp32 [2] = [n_clipped, n_masked],
    dloss/dvalues (w * (V - R), or w * (V_clip - R) on the clipped branch, 0 where the clip is active) or [0])."""
    m = mask != 0
    cd = compute_dtype(values)
    zero = torch.zeros((), dtype=cd, device=values.device)
    v = torch.where(m, values.to(cd), zero)
    old = torch.where(m, old_values.to(cd), zero)
    ret = torch.where(m, returns.to(cd), zero)
    diff = v - old
    v_clipped = old + diff.clamp(-clip, clip)
    l1, l2 = (v - ret) ** 2, (v_clipped - ret) ** 2
    clipped = (l2 > l1) & m
    w = torch.where(m, weights.to(cd), zero)
    loss = 0.5 * (w * torch.where(clipped, l2, l1)).sum()
    stats = torch.stack([clipped.sum().float(), m.sum().float()])
    if not need_grad:
        return loss, stats, torch.empty(0, dtype=cd, device=values.device)
    d = torch.where(clipped, torch.where(diff.abs() <= clip, v_clipped - ret, zero), v - ret)
    return loss, stats, w * d


# -------------------------------------------------------------------------------------------------- advantages
def packed_to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """``[N]`` packed -> ``[B, T_max]`` padded with ``fill`` (one host sync for T_max)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    n_seq, t_max = lens.shape[0], int(lens.max()) if lens.numel() else 0
    out = torch.full((n_seq, t_max), fill, dtype=x.dtype, device=x.device)
    col = torch.arange(t_max, device=x.device)
    valid = col[None, :] < lens[:, None]
    out[valid] = x[cu[0] : cu[-1]]
    return out


def padded_to_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Inverse of :func:`packed_to_padded`; tokens outside every sequence are 0."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < lens[:, None]
    out = torch.zeros(n_tokens, dtype=x.dtype, device=x.device)
    out[cu[0] : cu[-1]] = x[valid]
    return out


def _geometric_suffix_sum(x: torch.Tensor, c: float, block: int = 64) -> torch.Tensor:
    """y_k = sum_{j >= k} c^(j - k) x_j along dim 1 of ``[B, K]``: block-Toeplitz GEMM + recursion over blocks."""
    if c == 1.0:
        return x.flip(1).cumsum(1).flip(1)
    rows, k = x.shape
    if k <= block:
        i = torch.arange(k, device=x.device, dtype=x.dtype)
        expo = i[None, :] - i[:, None]
        toeplitz = torch.where(expo >= 0, torch.tensor(c, dtype=x.dtype, device=x.device) ** expo.clamp(min=0), 0.0)
        return x @ toeplitz.t()
    n_blocks = -(-k // block)
    xb = torch.nn.functional.pad(x, (0, n_blocks * block - k)).view(rows, n_blocks, block)
    local = _geometric_suffix_sum(xb.reshape(-1, block), c, block).view(rows, n_blocks, block)
    starts = _geometric_suffix_sum(local[:, :, 0].contiguous(), c**block, block)  # y at every block start
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # y at the next block's start
    i = torch.arange(block, device=x.device, dtype=x.dtype)
    y = local + (torch.tensor(c, dtype=x.dtype, device=x.device) ** (block - i)) * carry[:, :, None]
    return y.reshape(rows, -1)[:, :k]


def gae_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, reset: Tensor | None = None,
             whiten: bool = False) -> tuple[Tensor, Tensor]:
    """Multi-turn GAE on padded ``[B, T]`` tensors; returns fp32 (advantages, returns), 0 off-mask.

    The recursion runs over trained positions only (mask != 0): with p_1 < ... < p_K the trained positions of a
    row, delta_k = r'_k + gamma * V(p_{k+1}) - V(p_k) (V = 0 after p_K) and A_k = delta_k + gamma * lam * A_{k+1}.
    r'_k sums the rewards at positions p_k <= t < p_{k+1}: a reward on an untrained token is credited to the last
    trained token before it (the action that led to it); rewards before p_1 go to p_1. Values on untrained tokens
    are never read. ``reset`` (bool ``[B, T]``, optional) ends an episode segment after a trained token: there
    the next value and the carried advantage are 0 (used by the bi-level estimator). Returns = A + V (before
    whitening); ``whiten`` applies :func:`masked_whiten` to the advantages.

    Vectorised: without resets, for fp32 / fp16 / bf16 inputs and gamma * lam > 0, a scan in position space
    (:func:`_position_gae`, no index tensors). Otherwise trained tokens are compacted per row into ``[B, K_max]``
    (one host sync for K_max), the constant-coefficient recursion is a blocked Toeplitz GEMM
    (:func:`_geometric_suffix_sum`), results are scattered back. fp32 (fp64 with resets, whose formula subtracts
    suffix sums)."""
    m = mask if mask.dtype == torch.bool else mask != 0
    rows, t_len = m.shape
    dev = rewards.device
    cd = torch.float64 if reset is not None or rewards.dtype == torch.float64 else torch.float32
    if reset is None and cd == torch.float32 and gamma * lam > 0.0 and rows and 0 < t_len < 2**24:
        return _position_gae(rewards, values, m, gamma, lam, whiten)
    counts = m.sum(1)
    k_max = int(counts.max()) if rows and t_len else 0
    adv = torch.zeros(rows, t_len, dtype=torch.float32, device=dev)
    ret = torch.zeros_like(adv)
    if k_max == 0:
        return adv, ret
    pos = m.view(-1).nonzero().squeeze(1)  # flat positions of trained tokens, row-major
    row_start = torch.cumsum(counts, 0) - counts  # index in pos of each row's first trained token
    row = torch.div(pos, t_len, rounding_mode="floor")
    comp = torch.arange(pos.numel(), device=dev) - row_start[row] + row * (k_max + 1)  # flat [B, K_max + 1] index
    # reward owner: the last trained token at or before the reward (the first one for rewards before it)
    r_flat = rewards.reshape(-1)
    r_pos = r_flat.nonzero().squeeze(1)
    r_row = torch.div(r_pos, t_len, rounding_mode="floor")
    owner = torch.searchsorted(pos, r_pos, right=True) - 1 - row_start[r_row]
    has_owner = counts[r_row] > 0
    owner = owner.clamp(min=0) + r_row * (k_max + 1)
    r_c = torch.zeros(rows * (k_max + 1), dtype=cd, device=dev)
    r_c.index_add_(0, owner[has_owner], r_flat[r_pos[has_owner]].to(cd))
    r_c = r_c.view(rows, k_max + 1)
    v_c = torch.zeros(rows, k_max + 1, dtype=cd, device=dev)
    v_c.view(-1)[comp] = values.reshape(-1)[pos].to(cd)
    r_c, v_next, v_c = r_c[:, :k_max], v_c[:, 1:], v_c[:, :k_max]
    c = gamma * lam
    if reset is None:
        adv_c = _geometric_suffix_sum(r_c + gamma * v_next - v_c, c)
    else:
        rs = torch.ones(rows, k_max + 1, dtype=torch.bool, device=dev)  # padding columns act as resets
        rs.view(-1)[comp] = reset.reshape(-1)[pos].bool()
        rs = rs[:, :k_max]
        delta = r_c + gamma * torch.where(rs, 0.0, v_next) - v_c
        full = torch.nn.functional.pad(_geometric_suffix_sum(delta, c), (0, 1))
        # A_k = F_k - c^(e - k + 1) F_{e + 1}, e = first reset at or after k (a difference of suffix sums)
        idx = torch.arange(k_max, device=dev)
        seg_end = torch.where(rs, idx, k_max).flip(1).cummin(1).values.flip(1).clamp(max=k_max - 1)
        decay = torch.tensor(c, dtype=cd, device=dev) ** (seg_end - idx + 1).to(cd)
        adv_c = full[:, :k_max] - decay * full.gather(1, seg_end + 1)
    comp_k = comp - row  # the same index in the [B, K_max] layout
    adv_t = adv_c.reshape(-1)[comp_k]
    ret.view(-1)[pos] = (adv_t + v_c.reshape(-1)[comp_k]).float()
    if whiten:
        adv_t = _whiten_values(adv_t)
    adv.view(-1)[pos] = adv_t.float()
    return adv, ret


def _position_gae(rewards: Tensor, values: Tensor, m: Tensor, gamma: float, lam: float,
                  whiten: bool) -> tuple[Tensor, Tensor]:
    """fp32 multi-turn GAE in position space (no compaction, no index tensors), c = gamma * lam > 0.

    With N_j the number of trained tokens at or before j, the rule of :func:`gae_scan` unrolls to
    A_t = sum_{j >= t} c^(N_j - N_t) z_j - V_t / lam on trained t, z_j = r_j + k * m_j * V_j, k = (1 - lam) / lam
    (the next-value terms telescope; a reward on an untrained token u has N_u = N of its owner). That is a
    reversed scan with coefficient f = c on trained and 1 on untrained tokens: on the time-reversed rows, cut
    into blocks short enough that c^L stays in fp32 range (c^L >= e^-50), g = cumprod(f) and
    A + V / lam = g * cumsum(z * f / (c * g)) within a block (m * V * f = c * m * V); the few block carries are a
    loop over blocks vectorised over rows. gamma = lam = 1 reduces to a suffix sum of the rewards. Rewards before
    the first trained token are added to it separately. Then whitening over trained tokens (masked mean, unbiased
    std)."""
    rows, t_len = m.shape
    dev = m.device
    r = rewards.float()
    # fresh buffers are few and reused in place: on CPU, allocating a new [B, T] tensor per step costs more than
    # the arithmetic
    mf = m.view(torch.uint8).to(torch.float32)
    mv = torch.mul(values.float(), mf)
    if not math.isfinite(mv.sum()):  # inf / nan values on untrained tokens are never read
        mv = torch.where(m, values.float(), 0.0)
    ret = torch.empty(rows, t_len, dtype=torch.float32, device=dev)
    # first trained position p1 (T - p1 is the largest of mask * (T - t); 0 for a row with none)
    top = torch.mul(mf, torch.arange(t_len, 0, -1, dtype=torch.float32, device=dev), out=ret).amax(1)
    has = top > 0
    p1 = (t_len - top).long().clamp(max=t_len - 1)
    if gamma == 1.0 and lam == 1.0:
        adv = _flip_into(r, torch.empty_like(ret)).cumsum_(1)
        _flip_into(adv, ret).mul_(mf)  # suffix sums of the rewards
    else:
        c = gamma * lam
        k = (1.0 - lam) / lam
        block_max = max(1, int(50.0 / -math.log(c))) if c < 1.0 else t_len
        n_blocks = -(-t_len // min(block_max, t_len))
        block = -(-t_len // n_blocks)
        t_pad = n_blocks * block
        # time-reversed rows padded to whole blocks: f = c on trained, 1 on untrained tokens; y = z * f / c with
        # z = r + k * m * V (since m * V * f = c * m * V)
        padded = t_pad > t_len
        f = torch.ones(rows, t_pad, dtype=torch.float32, device=dev) if padded else ret
        y = torch.zeros(rows, t_pad, dtype=torch.float32, device=dev) if padded else torch.empty_like(ret)
        f[:, :t_len].copy_(m.flip(1).view(torch.uint8)).mul_(c - 1.0).add_(1.0)  # uint8: bool copies are slow
        adv = torch.mul(r, 1.0 / c, out=torch.empty_like(ret)).add_(mv, alpha=k / c)
        _flip_into(adv, y[:, :t_len]).mul_(f[:, :t_len])
        g = f.view(rows, n_blocks, block).cumprod_(2)  # c^(trained tokens so far in the block)
        acc = y.view(rows, n_blocks, block).div_(g).cumsum_(2)
        if n_blocks > 1:
            carry = torch.empty(rows, n_blocks, dtype=torch.float32, device=dev)
            last_acc, last_g = acc[:, :, -1], g[:, :, -1]
            h = torch.zeros(rows, dtype=torch.float32, device=dev)
            for b in range(n_blocks):
                carry[:, b] = h
                h = (last_acc[:, b] + h) * last_g[:, b]
            acc.add_(carry[:, :, None])
        acc.mul_(g)
        ret = _flip_into(y[:, :t_len], ret).mul_(mf).sub_(mv, alpha=k)  # A + V (ret held g, now dead)
    if bool(has.any()):
        f_max = int(torch.where(has, p1, 0).max()) + 1
        before = (torch.arange(f_max, device=dev)[None, :] < p1[:, None]).to(torch.float32)
        pre = (r[:, :f_max] * before).sum(1) * has
        ret[torch.arange(rows, device=dev), p1] += pre
    adv = torch.sub(ret, mv, out=adv)
    if whiten:
        n = mf.sum()
        mean = float(adv.sum()) / max(float(n), 1.0)
        adv.add_(mf, alpha=-mean)  # centred, still 0 off the mask
        var = torch.dot(adv.view(-1), adv.view(-1)) / (n - 1).clamp(min=1)
        adv.mul_(torch.rsqrt(var + 1e-8))
    return adv, ret


def _flip_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` = x reversed along dim 1, without a temporary where torch has flip.out."""
    if _FLIP_OUT:
        return torch.ops.aten.flip.out(x, [1], out=out)
    return out.copy_(x.flip(1))


_FLIP_OUT = hasattr(torch.ops.aten.flip, "out")


def _whiten_values(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    x = x.double()
    n = x.numel()
    mean = x.mean() if n else x.sum()
    var = ((x - mean) ** 2).sum() / max(n - 1, 1)
    return (x - mean) * torch.rsqrt(var + eps)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var, as verl); 0 off the mask."""
    m = mask != 0
    n = m.sum()
    xd = torch.where(m, x.double(), 0.0)
    mean = xd.sum() / n.clamp(min=1)
    var = torch.where(m, (xd - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(m, (xd - mean) * torch.rsqrt(var + eps), 0.0).float()


def padded_view(tensors: list[Tensor | None], cu_seqlens: Tensor | None) -> list[Tensor | None]:
    """The tensors as padded [B, T] (unchanged when cu_seqlens is None); None entries stay None."""
    if cu_seqlens is None:
        return tensors
    return [packed_to_padded(t, cu_seqlens) if t is not None else None for t in tensors]


def unpad(outs: tuple[Tensor, ...], cu_seqlens: Tensor | None, n_tokens: int) -> tuple[Tensor, ...]:
    """Inverse of :func:`padded_view` for a tuple of outputs."""
    if cu_seqlens is None:
        return outs
    return tuple(padded_to_packed(o, cu_seqlens, n_tokens) for o in outs)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True, cu_seqlens: Tensor | None = None,
                   skip_observations: bool = True) -> tuple[Tensor, Tensor]:
    """Multi-turn GAE (see :func:`gae_scan`), then masked whitening over the batch. Padded ``[B, T]`` or packed
    ``[N]`` + cu_seqlens; returns fp32 (advantages, returns). ``skip_observations=False``: verl's per-position
    GAE over every token from each row's first trained token on (see :func:`verl_gae`)."""
    if not skip_observations:
        return verl_gae(rewards, values, mask, gamma, lam, whiten, cu_seqlens)
    r, v, m = padded_view([rewards, values, mask], cu_seqlens)
    return unpad(gae_scan(r, v, m, gamma, lam, whiten=whiten), cu_seqlens, mask.shape[0])


def response_span(mask: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """bool, mask's shape: True from each row's (sequence's) first trained token to its end, the positions verl
    calls the response when the prompt is everything before the first model token."""
    m = (mask != 0).long()
    if cu_seqlens is None:
        return m.cumsum(-1) > 0
    total = m.cumsum(0)
    before = torch.nn.functional.pad(total, (1, 0))[cu_seqlens[:-1].long()]  # trained tokens before each sequence
    n_seq = cu_seqlens.shape[0] - 1
    seq = sequence_index(cu_seqlens, m.shape[0])
    inside = seq < n_seq  # tokens past cu_seqlens[-1] belong to no sequence
    return inside & ((total - before[seq.clamp(max=max(n_seq - 1, 0))]) > 0)


def verl_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
             cu_seqlens: Tensor | None = None,
             scan: Callable[..., tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, Tensor]:
    """GAE as verl@1e47e41 ``compute_gae_advantage_return`` (the version RAGEN pins): the recursion
    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1} walks every position of the
    response span (:func:`response_span`), observation tokens included (their values are read and gamma / lam
    decay across them); V after the last position = 0. Rewards before the first trained token go to it.
    Advantages and returns (A + V) are then kept on trained tokens only (0 elsewhere) and advantages whitened over
    them. Equal to :func:`gae_advantages` with skip_observations when gamma = lam = 1 (both are then the reward
    suffix sum minus V_t) or when no observation token lies between two trained tokens. ``scan`` (signature of
    :func:`gae_scan`) runs the recursion; the Triton path passes its kernel."""
    span = response_span(mask, cu_seqlens)
    m = mask != 0
    if scan is None:
        r, v, s = padded_view([rewards, values, span], cu_seqlens)
        adv, ret = unpad(gae_scan(r, v, s, gamma, lam), cu_seqlens, mask.shape[0])
    else:
        adv, ret = scan(rewards, values, span, gamma, lam)
    adv = torch.where(m, adv, 0.0)
    if whiten:
        adv = masked_whiten(adv, m)
    return adv.float(), torch.where(m, ret, 0.0).float()


def turn_structure(mask: Tensor, turn_end: Tensor) -> tuple[Tensor, Tensor]:
    """For padded ``[B, T]``: (is_end, owner_end). is_end marks the last trained token of every turn: a turn is
    a maximal run of trained tokens with no ``turn_end`` flag between them (the flag on position t separates
    t from t + 1; the row end always closes a turn). owner_end[t] is the position of the turn end at or after t."""
    m = mask != 0
    rows, t_len = m.shape
    idx = torch.arange(t_len, device=m.device).expand(rows, t_len)
    nxt_incl = torch.where(m, idx, t_len).flip(1).cummin(1).values.flip(1)
    nxt = torch.nn.functional.pad(nxt_incl[:, 1:], (0, 1), value=t_len)  # next trained position after t
    ends_before = torch.nn.functional.pad(turn_end.bool().long().cumsum(1), (1, 0))  # flags at < t
    flags_between = ends_before.gather(1, nxt.clamp(max=t_len)) - ends_before[:, :-1]  # flags in [t, nxt)
    is_end = m & ((nxt == t_len) | (flags_between > 0))
    owner_end = torch.where(is_end, idx, t_len).flip(1).cummin(1).values.flip(1)
    return is_end, owner_end


def reward_turn_ends(rewards: Tensor, mask: Tensor) -> Tensor:
    """bool ``[B, T]``: RAGEN's turn ends (ragen/trainer/core_algos.py bi-level GAE), the trained tokens that hold a
    non-zero reward once rewards are credited to trained tokens as in :func:`gae_scan`. With one end-of-episode
    reward this gives one turn per trajectory, so the turn-level discount gamma_high never applies."""
    m = mask != 0
    t_len = m.shape[1]
    pos = torch.arange(t_len, device=m.device)
    first = torch.where(m, pos, t_len).amin(1, keepdim=True)
    last_incl = torch.where(m, pos, -1).cummax(1).values
    owner = torch.where(last_incl >= 0, last_incl, first).clamp(max=t_len - 1)
    credited = torch.zeros(m.shape, dtype=torch.float64, device=m.device).scatter_add_(1, owner,
                                                                                       rewards.to(torch.float64))
    return m & (credited != 0)


def bilevel_gae_scan(rewards: Tensor, values: Tensor, mask: Tensor, turn_end: Tensor, gamma: float, lam: float,
                     gamma_high: float, lam_high: float,
                     scan: Callable[..., tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, Tensor]:
    """Un-whitened bi-level GAE on padded tensors (RAGEN's turn-level + token-level estimator).

    1. Rewards are credited to trained tokens as in :func:`gae_scan`; a turn's reward R_i is the sum over its
       tokens. 2. Turn level: GAE over turn ends with gamma_high / lam_high (next value = value at the next turn
       end), giving the turn return G_i = A_i + V(end_i). 3. Token level: GAE within each turn with gamma / lam,
       reward G_i on the turn's last token, next value and carry 0 after it. Returns (advantages, returns).
    ``scan`` (same signature as :func:`gae_scan`, the default) runs steps 2 and 3; the Triton path passes its
    kernel. Turns are the ones :func:`turn_structure` finds from the explicit ``turn_end`` flags."""
    scan = scan or gae_scan
    m = mask != 0
    is_end, owner_end = turn_structure(m, turn_end)
    rows, t_len = m.shape
    f64 = torch.float64
    first = torch.where(m, torch.arange(t_len, device=m.device), t_len).amin(1, keepdim=True)
    # reward owner position: last trained position <= t (first trained position for t before it)
    last_incl = torch.where(m, torch.arange(t_len, device=m.device), -1).cummax(1).values
    owner_pos = torch.where(last_incl >= 0, last_incl, first).clamp(max=t_len - 1)
    token_r = torch.zeros(rows, t_len, dtype=f64, device=m.device).scatter_add_(1, owner_pos, rewards.to(f64))
    token_r = torch.where(m, token_r, 0.0)
    turn_r = torch.zeros(rows, t_len + 1, dtype=f64, device=m.device).scatter_add_(1, owner_end, token_r)[:, :t_len]
    adv_high, _ = scan(turn_r, values, is_end, gamma_high, lam_high)
    turn_return = torch.where(is_end, adv_high.to(f64) + values.to(f64), 0.0)
    return scan(turn_return, values, m, gamma, lam, reset=is_end)


def bilevel_gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, turn_end: Tensor, gamma: float = 1.0,
                           lam: float = 1.0, gamma_high: float = 0.95, lam_high: float | None = None,
                           whiten: bool = True, cu_seqlens: Tensor | None = None,
                           turns: str = "turn_end") -> tuple[Tensor, Tensor]:
    """Bi-level GAE (see :func:`bilevel_gae_scan`) + masked whitening; padded or packed; fp32 (adv, returns).
    ``turns``: "turn_end" (the explicit flags) or "reward" (RAGEN's rule, :func:`reward_turn_ends`; turn_end is
    then not read)."""
    r, v, m, te = padded_view([rewards, values, mask, turn_end], cu_seqlens)
    if turns == "reward":
        te = reward_turn_ends(r, m)
    adv, ret = bilevel_gae_scan(r, v, m, te, gamma, lam, gamma_high, lam if lam_high is None else lam_high)
    if whiten:
        adv = masked_whiten(adv, m)
    return unpad((adv, ret), cu_seqlens, mask.shape[0])


def grpo_scores(scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool, eps: float) -> torch.Tensor:
    """Per-sequence GRPO advantage ``[B]`` fp32: (R - mean_group) / (std_group + eps), unbiased std; a group of
    one gets 0. Vectorised with unique + index_add (no loop over groups)."""
    s = scores.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, inv, torch.ones_like(s))
    mean = torch.zeros_like(count).index_add_(0, inv, s) / count
    dev = s - mean[inv]
    if not norm_by_std:
        return dev.float()
    var = torch.zeros_like(count).index_add_(0, inv, dev * dev) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), 0.0)
    return (dev / (std[inv] + eps)).float()


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor,
                        cu_seqlens: Tensor | None = None) -> torch.Tensor:
    """``[B]`` -> the mask's shape, 0 on untrained tokens (padded ``[B, T]`` or packed ``[N]`` + cu_seqlens)."""
    m = mask if mask.dtype == torch.bool else mask != 0  # seq_values are finite: a product zeroes off-mask tokens
    if cu_seqlens is None:
        return seq_values[:, None] * m
    seq = sequence_index(cu_seqlens, m.shape[0])
    inside = seq < seq_values.shape[0]
    return seq_values[seq.clamp(max=max(seq_values.shape[0] - 1, 0))] * (m & inside)


def grpo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6,
                    cu_seqlens: Tensor | None = None) -> Tensor:
    """GRPO advantages broadcast to trained tokens: fp32, mask's shape."""
    return broadcast_to_tokens(grpo_scores(scores, group_ids, norm_by_std, eps), mask, cu_seqlens)
