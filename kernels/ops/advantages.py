"""Triton kernels for the advantage estimators: multi-turn GAE (with optional segment resets, which the bi-level
estimator uses) and GRPO. No autograd (advantages are constants of the loss).

Sequences are addressed through ``cu_seqlens`` (int64 [B + 1]) over flat token arrays, so one kernel serves the
padded [B, T] layout (cu_seqlens = arange(B + 1) * T) and the packed [N] one. One program per sequence; the GAE
program walks its sequence backwards in BLOCK_T tiles and solves the recursions inside a tile with
``tl.associative_scan`` over affine maps, carrying the state between tiles: a single pass, no per-position
launches. Entry points mirror ``reference.gae_scan`` and ``reference.grpo_scores``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Tile sizes on CUDA: positions per GAE / GRPO tile, sequences per GRPO group-compare tile.
GPU_BLOCK_T = 1024
GPU_BLOCK_B = 1024


@triton.jit
def _affine2(a1, x1, a2, x2):
    # composition of X -> a1 X + x1 followed by X -> a2 X + x2 (a forward scan over reversed positions)
    return a1 * a2, x1 * a2 + x2


@triton.jit
def _affine3(a1, x1, y1, a2, x2, y2):
    return a1 * a2, x1 * a2 + x2, y1 * a2 + y2


@triton.jit
def _last(x, idx, BLOCK_T: tl.constexpr):
    return tl.sum(tl.where(idx == BLOCK_T - 1, x, 0.0), 0)


# Kernel: one program per sequence [start, end) of the flat arrays r, v, mask (and reset). Computes un-whitened
# multi-turn GAE (see reference.gae_scan): a forward prepass finds the first trained position p1 and the
# rewards before it; then tiles are visited from the end, positions inside a tile in descending order (so a
# reverse-time recursion is a forward scan). Per tile: scan 1 gives NV_t (value at the next trained position
# after t) and R_t (rewards from t up to that position), both X_t = (1 - m_{t+1}) X_{t+1} + b_t; then
# delta = R + gamma * NV - V on trained tokens, and scan 2 gives A_t = m_t ? delta_t + gl * A_{t+1} : A_{t+1}
# (gl = gamma * lam, 0 after a reset). Writes fp32 adv (0 off-mask) and returns = adv + V.
@triton.jit
def _gae_kernel(r_ptr, v_ptr, m_ptr, reset_ptr, cu_ptr, adv_ptr, ret_ptr, gamma, gl,
                HAS_RESET: tl.constexpr, BLOCK_T: tl.constexpr):
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    idx = tl.arange(0, BLOCK_T)
    # prepass: first trained position and the rewards that precede it (credited to it)
    first = end
    pre = 0.0
    t0 = start
    while (t0 < end) & (first == end):
        pos = t0 + idx
        ok = pos < end
        trained = tl.load(m_ptr + pos, mask=ok, other=0) != 0
        first = tl.min(tl.where(trained & ok, pos, end), 0)
        pre += tl.sum(tl.load(r_ptr + pos, mask=ok & (pos < first), other=0.0).to(tl.float32), 0)
        t0 += BLOCK_T
    carry_nv = 0.0
    carry_r = 0.0
    carry_a = 0.0
    n_tiles = tl.cdiv(end - start, BLOCK_T)
    for tile in range(0, n_tiles):
        pos = end - 1 - tile * BLOCK_T - idx
        ok = pos >= start
        nxt_ok = ok & (pos + 1 < end)
        trained = ok & (tl.load(m_ptr + pos, mask=ok, other=0) != 0)
        m_next = tl.where(nxt_ok & (tl.load(m_ptr + pos + 1, mask=nxt_ok, other=0) != 0), 1.0, 0.0)
        v = tl.load(v_ptr + pos, mask=trained, other=0.0).to(tl.float32)
        v_next = tl.load(v_ptr + pos + 1, mask=m_next > 0, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + pos, mask=ok, other=0.0).to(tl.float32) + tl.where(pos == first, pre, 0.0)
        a = tl.where(ok, 1.0 - m_next, 1.0)
        acc_a, acc_nv, acc_r = tl.associative_scan((a, m_next * v_next, r), 0, _affine3)
        nv = acc_a * carry_nv + acc_nv
        rr = acc_a * carry_r + acc_r
        if HAS_RESET:
            reset = trained & (tl.load(reset_ptr + pos, mask=ok, other=0) != 0)
            nv = tl.where(reset, 0.0, nv)
            decay = tl.where(reset, 0.0, gl)
        else:
            decay = gl
        delta = rr + gamma * nv - v
        acc_c, acc_d = tl.associative_scan((tl.where(trained, decay, 1.0), tl.where(trained, delta, 0.0)), 0,
                                           _affine2)
        adv = tl.where(trained, acc_c * carry_a + acc_d, 0.0)
        tl.store(adv_ptr + pos, adv, mask=ok)
        tl.store(ret_ptr + pos, tl.where(trained, adv + v, 0.0), mask=ok)
        carry_nv = _last(nv, idx, BLOCK_T)
        carry_r = _last(rr, idx, BLOCK_T)
        carry_a = _last(acc_c * carry_a + acc_d, idx, BLOCK_T)


def _mask_arg(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def row_offsets(mask: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """cu_seqlens as int64, or the row starts of a padded [B, T] tensor."""
    if cu_seqlens is not None:
        return cu_seqlens.to(torch.int64).contiguous()
    rows, length = mask.shape
    return torch.arange(rows + 1, device=mask.device, dtype=torch.int64) * length


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
             reset: torch.Tensor | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-whitened multi-turn GAE (semantics of ``reference.gae_scan``) on padded [B, T] tensors, or packed [N]
    ones with cu_seqlens. Returns fp32 (advantages, returns) of mask's shape, 0 off-mask."""
    cu = row_offsets(mask, cu_seqlens)
    adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    ret = torch.zeros_like(adv)
    n_seq = cu.shape[0] - 1
    if n_seq > 0 and mask.numel():
        block = GPU_BLOCK_T if mask.is_cuda else 256
        _gae_kernel[(n_seq,)](
            rewards.contiguous().reshape(-1), values.contiguous().reshape(-1), _mask_arg(mask),
            _mask_arg(reset) if reset is not None else _mask_arg(mask), cu, adv.view(-1), ret.view(-1),
            float(gamma), float(gamma * lam), HAS_RESET=reset is not None, BLOCK_T=block,
        )
    return adv, ret


@triton.jit
def _same_group(j, n, key_ptr, key, key2_ptr, key2, TWO_KEYS: tl.constexpr):
    """Which of the entries j (< n) share ``key`` (and ``key2`` when TWO_KEYS)."""
    ok = j < n
    same = ok & (tl.load(key_ptr + j, mask=ok, other=0) == key)
    if TWO_KEYS:
        same = same & (tl.load(key2_ptr + j, mask=ok, other=0) == key2)
    return same


@triton.jit
def _group_advantage(value, val_ptr, key_ptr, key, key2_ptr, key2, n, eps, NORM: tl.constexpr,
                     TWO_KEYS: tl.constexpr, BLOCK: tl.constexpr):
    """(value - mean) [/ (std + eps)] over the group of entries j < n whose key_ptr[j] == key (and
    key2_ptr[j] == key2 when TWO_KEYS), and the group's size (fp32). The group is found by comparing all n
    entries in BLOCK tiles (no sort, no host sync); two passes (sum, then squared deviations), unbiased std, 0
    for a group of one. Shared by the GRPO kernel and both GiGPO group levels (episode, step)."""
    count = 0.0
    total = 0.0
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        same = _same_group(j, n, key_ptr, key, key2_ptr, key2, TWO_KEYS)
        count += tl.sum(same.to(tl.float32), 0)
        total += tl.sum(tl.load(val_ptr + j, mask=same, other=0.0).to(tl.float32), 0)
    mean = total / count
    adv = value - mean
    if NORM:
        sq = 0.0
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            same = _same_group(j, n, key_ptr, key, key2_ptr, key2, TWO_KEYS)
            dev = tl.load(val_ptr + j, mask=same, other=0.0).to(tl.float32) - mean
            sq += tl.sum(tl.where(same, dev * dev, 0.0), 0)
        std = tl.where(count > 1, tl.sqrt(sq / tl.maximum(count - 1.0, 1.0)), 0.0)
        adv = adv / (std + eps)
    return adv, count


# Kernel: one program per sequence i; its group advantage (_group_advantage over the B group ids: O(B^2)
# compares, no sort, no host sync): group count and sum, then the sum of squared deviations (two-pass, exact).
# Writes the sequence's advantage (R_i - mean) / (std + eps) (unbiased std, 0 for a group of one) to
# seq_adv[i] and broadcasts it to the sequence's tokens [start, end) of the flat output where mask != 0.
@triton.jit
def _grpo_kernel(score_ptr, gid_ptr, mask_ptr, cu_ptr, seq_adv_ptr, out_ptr, B, eps,
                 NORM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    i = tl.program_id(0)
    adv, _ = _group_advantage(tl.load(score_ptr + i).to(tl.float32), score_ptr, gid_ptr, tl.load(gid_ptr + i),
                              gid_ptr, 0, B, eps, NORM, False, BLOCK_B)
    tl.store(seq_adv_ptr + i, adv)
    start = tl.load(cu_ptr + i).to(tl.int64)
    end = tl.load(cu_ptr + i + 1).to(tl.int64)
    for t0 in range(start, end, BLOCK_T):
        pos = t0 + tl.arange(0, BLOCK_T)
        ok = pos < end
        trained = tl.load(mask_ptr + pos, mask=ok, other=0) != 0
        tl.store(out_ptr + pos, tl.where(trained, adv, 0.0), mask=ok)


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, norm_by_std: bool, eps: float,
                    cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence advantages fp32 [B], token advantages fp32 of mask's shape)."""
    n_seq = scores.shape[0]
    cu = row_offsets(mask, cu_seqlens)
    seq_adv = torch.empty(n_seq, dtype=torch.float32, device=scores.device)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if n_seq:
        big = scores.is_cuda
        _grpo_kernel[(n_seq,)](scores.contiguous(), group_ids.contiguous(), _mask_arg(mask), cu, seq_adv,
                               out.view(-1), n_seq, float(eps), NORM=bool(norm_by_std),
                               BLOCK_B=GPU_BLOCK_B if big else 256, BLOCK_T=GPU_BLOCK_T if big else 512)
    return seq_adv, out
