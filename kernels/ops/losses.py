"""Triton kernels for the PPO policy loss and the clipped value loss on per-token tensors.

Both losses are weighted token sums, loss = sum_t w_t * l_t, where the weights w (fp32, 0 off the mask) encode the
aggregation mode (``reference.aggregation_weights``). So the whole op is one pass over the tokens: it writes
per-program partial sums (summed by the host: deterministic, no atomics) and, when a gradient is wanted, the
per-token derivative w_t * dl_t/dx_t, which the backward only scales by the loss's gradient (no recompute, no
second kernel). All tensors are flattened, contiguous, of one length N; inputs of any float dtype are cast to
fp32 right after the load. Entry points mirror ``reference.ppo_loss_fwd`` and ``reference.value_loss_fwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import LOG_RATIO_CLAMP

_N_PPO_STATS = 7  # loss, clipped, dual clipped, sum(-log ratio), sum(entropy), sum(kl), n masked


#: Tokens per program on CUDA (the CPU interpreter takes larger blocks: fewer programs to emulate).
GPU_BLOCK = 1024


def _block(t: torch.Tensor) -> int:
    return GPU_BLOCK if t.is_cuda else 4096


@triton.jit
def _ppo_token(lp, old, adv, eps_low, eps_high, clip_c, LOG_RATIO_CLAMP: tl.constexpr):
    """Per-token clipped + dual-clipped surrogate: (pg, clipped, dual, log_ratio, ratio, out_of_clamp)."""
    raw = lp - old
    log_ratio = tl.minimum(tl.maximum(raw, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    ratio = tl.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    clipped = pg2 > pg1
    pg = tl.where(clipped, pg2, pg1)
    neg = adv < 0
    pg3 = tl.where(neg, tl.where(neg, -adv, 1.0) * clip_c, 0.0)  # no 0 * inf in the lanes it discards
    dual = neg & (pg > pg3)
    pg = tl.where(dual, pg3, pg)
    out_of_clamp = (raw < -LOG_RATIO_CLAMP) | (raw > LOG_RATIO_CLAMP)
    return pg, clipped, dual, log_ratio, ratio, out_of_clamp


# Kernel: grid cdiv(N, BLOCK). Loads logp, old_logp, advantages, weights, mask (+ ref_logp, entropy, is_weight
# when present), zeroing masked tokens right after the load; computes the per-token PPO loss (clip, dual clip,
# off-policy weight c on the clipped term, KL k1/k3, entropy bonus), writes 7 fp32 partial sums per program to
# part[pid, :] and, with NEED_GRAD, the derivative dlogp = w * (c * (-A r unless a clip branch is strictly taken
# or the log-ratio clamp is active) + kl_coef * dkl) with dkl = 1 (k1) or 1 - exp(ref - logp) (k3), c = 1 without
# is_weight. Backward: a scale of dlogp; d entropy = -entropy_coef * w.
@triton.jit
def _ppo_fwd_kernel(lp_ptr, old_ptr, adv_ptr, w_ptr, mask_ptr, ref_ptr, ent_ptr, isw_ptr, part_ptr, dlp_ptr, N,
                    eps_low, eps_high, clip_c, kl_coef, ent_coef,
                    HAS_REF: tl.constexpr, KL_TYPE: tl.constexpr, HAS_ENT: tl.constexpr, HAS_ISW: tl.constexpr,
                    NEED_GRAD: tl.constexpr, LOG_RATIO_CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    mk = ok & (tl.load(mask_ptr + offs, mask=ok, other=0) != 0)
    lp = tl.where(mk, tl.load(lp_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    old = tl.where(mk, tl.load(old_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    adv = tl.where(mk, tl.load(adv_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    w = tl.where(mk, tl.load(w_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    pg, clipped, dual, log_ratio, ratio, out_of_clamp = _ppo_token(lp, old, adv, eps_low, eps_high, clip_c,
                                                                   LOG_RATIO_CLAMP)
    per_token = pg
    d = tl.where(clipped | dual | out_of_clamp, 0.0, -adv * ratio)
    if HAS_ISW:  # a compile-time switch: without is_weight the kernel is the uncorrected one, bit for bit
        c = tl.where(mk, tl.load(isw_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
        per_token = c * per_token
        d = c * d
    kl = tl.zeros([BLOCK], dtype=tl.float32)
    ent = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_REF:
        ref = tl.where(mk, tl.load(ref_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
        if KL_TYPE == 0:
            kl = lp - ref
            d += kl_coef
        else:
            back = tl.exp(ref - lp)
            kl = back - (ref - lp) - 1.0
            d += kl_coef * (1.0 - back)
        per_token += kl_coef * kl
    if HAS_ENT:
        ent = tl.where(mk, tl.load(ent_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
        per_token -= ent_coef * ent
    if NEED_GRAD:
        tl.store(dlp_ptr + offs, w * d, mask=ok)
    out = part_ptr + pid * 7
    tl.store(out, tl.sum(w * per_token, 0))
    tl.store(out + 1, tl.sum((clipped & mk).to(tl.float32), 0))
    tl.store(out + 2, tl.sum((dual & mk).to(tl.float32), 0))
    tl.store(out + 3, tl.sum(tl.where(mk, -log_ratio, 0.0), 0))
    tl.store(out + 4, tl.sum(ent, 0))
    tl.store(out + 5, tl.sum(kl, 0))
    tl.store(out + 6, tl.sum(mk.to(tl.float32), 0))


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.reshape(-1) if t is not None else None


def _mask_arg(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape(-1).view(torch.uint8) if mask.dtype == torch.bool else mask.reshape(-1)


def ppo_loss_fwd(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                 mask: torch.Tensor, ref_logp: torch.Tensor | None, entropy: torch.Tensor | None, eps_low: float,
                 eps_high: float, clip_c: float, kl_coef: float, kl_type: int, entropy_coef: float,
                 need_grad: bool = True, is_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.ppo_loss_fwd``: (loss fp32 [], stats fp32 [6], dlogp fp32 or [0])."""
    n = logp.numel()
    block = _block(logp)
    grid = max(1, triton.cdiv(n, block))
    part = torch.zeros(grid, _N_PPO_STATS, dtype=torch.float32, device=logp.device)
    d_logp = torch.empty(logp.shape if need_grad else (0,), dtype=torch.float32, device=logp.device)
    if n:
        _ppo_fwd_kernel[(grid,)](
            _flat(logp), _flat(old_logp), _flat(advantages), _flat(weights), _mask_arg(mask),
            _flat(ref_logp) if ref_logp is not None else logp, _flat(entropy) if entropy is not None else logp,
            _flat(is_weight) if is_weight is not None else logp,
            part, d_logp.view(-1) if need_grad else part, n, eps_low, eps_high, clip_c, kl_coef, entropy_coef,
            HAS_REF=ref_logp is not None, KL_TYPE=kl_type, HAS_ENT=entropy is not None,
            HAS_ISW=is_weight is not None, NEED_GRAD=need_grad, LOG_RATIO_CLAMP=LOG_RATIO_CLAMP, BLOCK=block,
        )
    total = part.sum(0)
    return total[0], total[1:].clone(), d_logp


# Kernel: grid cdiv(N, BLOCK). Clipped value loss 0.5 * w * max((V - R)^2, (V_old + clip(V - V_old) - R)^2)
# (clipped branch only when strictly larger); writes partials [loss, n_clipped, n_masked] per program and, with
# NEED_GRAD, dV = w * (V - R), or w * (V_clip - R) on the clipped branch when |V - V_old| <= clip (else 0).
@triton.jit
def _value_fwd_kernel(v_ptr, old_ptr, ret_ptr, w_ptr, mask_ptr, part_ptr, dv_ptr, N, clip,
                      NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    mk = ok & (tl.load(mask_ptr + offs, mask=ok, other=0) != 0)
    v = tl.where(mk, tl.load(v_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    old = tl.where(mk, tl.load(old_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    ret = tl.where(mk, tl.load(ret_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    w = tl.where(mk, tl.load(w_ptr + offs, mask=mk, other=0.0).to(tl.float32), 0.0)
    diff = v - old
    v_clip = old + tl.minimum(tl.maximum(diff, -clip), clip)
    l1 = (v - ret) * (v - ret)
    l2 = (v_clip - ret) * (v_clip - ret)
    clipped = (l2 > l1) & mk
    if NEED_GRAD:
        inside = (diff >= -clip) & (diff <= clip)
        tl.store(dv_ptr + offs, w * tl.where(clipped, tl.where(inside, v_clip - ret, 0.0), v - ret), mask=ok)
    out = part_ptr + pid * 3
    tl.store(out, tl.sum(0.5 * w * tl.where(clipped, l2, l1), 0))
    tl.store(out + 1, tl.sum(clipped.to(tl.float32), 0))
    tl.store(out + 2, tl.sum(mk.to(tl.float32), 0))


def value_loss_fwd(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor,
                   mask: torch.Tensor, clip: float,
                   need_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.value_loss_fwd``: (loss fp32 [], stats fp32 [2], dvalues fp32 or [0])."""
    n = values.numel()
    block = _block(values)
    grid = max(1, triton.cdiv(n, block))
    part = torch.zeros(grid, 3, dtype=torch.float32, device=values.device)
    d_values = torch.empty(values.shape if need_grad else (0,), dtype=torch.float32, device=values.device)
    if n:
        _value_fwd_kernel[(grid,)](_flat(values), _flat(old_values), _flat(returns), _flat(weights),
                                   _mask_arg(mask), part, d_values.view(-1) if need_grad else part, n, clip,
                                   NEED_GRAD=need_grad, BLOCK=block)
    total = part.sum(0)
    return total[0], total[1:].clone(), d_values
