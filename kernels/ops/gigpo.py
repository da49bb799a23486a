"""Triton kernels of the GiGPO estimator (episode-level group advantages + step-level advantages over anchor
states), semantics of ``reference_gigpo.gigpo_advantages``. No autograd (advantages are constants of the loss).

Inputs are turn-major: M turns in all, trajectory b owning turns ``cu_turns[b]:cu_turns[b + 1]``; each turn has
the key of the state it starts from and its reward; ``turn_ids`` [N] maps every token to its turn (-1: none).
Three launches, none of which syncs with the host or sorts:

1. one program per trajectory: its group's mean / std over the B scores (O(B) compares per program, as the GRPO
   kernel) -> the episode advantage, then the discounted returns of its turns (a serial reverse loop: a trajectory
   has tens of turns at most);
2. one program per turn: its step group = the turns of the same group with the same state key, found by comparing
   against all M turns in BLOCK tiles (O(M^2) compares in all: M is a few thousand turns per batch, far below
   what a sort-based grouping would need to pay off), two-pass mean / std of their returns -> the step advantage
   and the turn's advantage = episode advantage + w * step advantage;
3. one program per BLOCK tokens: gather the turn advantage of each trained token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .advantages import _group_advantage, _mask_arg


# Kernel 1: program i = trajectory i. Episode advantage (R_i - mean) [/ (std + eps)] over the trajectories with
# the same group id (unbiased std; 0 for a group of one), then G_t = r_t + gamma * G_{t+1} over its turns.
@triton.jit
def _episode_kernel(score_ptr, gid_ptr, cu_turn_ptr, reward_ptr, ep_ptr, ret_ptr, B, eps, gamma,
                    NORM: tl.constexpr, BLOCK_B: tl.constexpr):
    i = tl.program_id(0)
    adv, _ = _group_advantage(tl.load(score_ptr + i).to(tl.float32), score_ptr, gid_ptr, tl.load(gid_ptr + i),
                              gid_ptr, 0, B, eps, NORM, False, BLOCK_B)
    tl.store(ep_ptr + i, adv)
    t0 = tl.load(cu_turn_ptr + i).to(tl.int64)
    t1 = tl.load(cu_turn_ptr + i + 1).to(tl.int64)
    g = 0.0
    for k in range(0, t1 - t0):
        m = t1 - 1 - k
        g = tl.load(reward_ptr + m).to(tl.float32) + gamma * g
        tl.store(ret_ptr + m, g)


# Kernel 2: program m = turn m. Step group of m = turns u with group[u] == group[m] and key[u] == key[m] (a
# state visited twice by one trajectory counts twice). Step advantage (G_m - mean) [/ (std + eps)]; a singleton
# gets exactly 0 (its mean is its own return). Writes step_adv[m], size[m] and turn_adv[m].
@triton.jit
def _step_kernel(key_ptr, tgid_ptr, ttraj_ptr, ret_ptr, ep_ptr, step_ptr, size_ptr, turn_adv_ptr, M, eps, w,
                 NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.program_id(0)
    adv, count = _group_advantage(tl.load(ret_ptr + m), ret_ptr, key_ptr, tl.load(key_ptr + m), tgid_ptr,
                                  tl.load(tgid_ptr + m), M, eps, NORM, True, BLOCK_M)
    tl.store(step_ptr + m, adv)
    tl.store(size_ptr + m, count.to(tl.int64))
    traj = tl.load(ttraj_ptr + m)
    tl.store(turn_adv_ptr + m, tl.load(ep_ptr + traj) + w * adv)


# Kernel 3: out[n] = turn_adv[turn_ids[n]] on trained tokens that belong to a turn, else 0.
@triton.jit
def _scatter_kernel(tid_ptr, mask_ptr, turn_adv_ptr, out_ptr, N, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    tid = tl.load(tid_ptr + n, mask=ok, other=-1)
    trained = ok & (tl.load(mask_ptr + n, mask=ok, other=0) != 0) & (tid >= 0)
    val = tl.load(turn_adv_ptr + tid, mask=trained, other=0.0)
    tl.store(out_ptr + n, tl.where(trained, val, 0.0), mask=ok)


def gigpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, turn_keys: torch.Tensor, turn_rewards: torch.Tensor,
                     cu_turns: torch.Tensor, turn_ids: torch.Tensor, mask: torch.Tensor, step_weight: float,
                     step_gamma: float, norm_by_std: bool,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token advantages fp32 [N], step advantages fp32 [M], step group sizes int64 [M]); inputs as
    ``reference_gigpo.gigpo_advantages`` (checked by the caller)."""
    n_seq, n_turns, n_tok = scores.shape[0], turn_keys.shape[0], mask.shape[0]
    dev = scores.device
    out = torch.zeros(n_tok, dtype=torch.float32, device=dev)
    step = torch.zeros(n_turns, dtype=torch.float32, device=dev)
    size = torch.zeros(n_turns, dtype=torch.int64, device=dev)
    if n_seq == 0:
        return out, step, size
    big = scores.is_cuda
    cu = cu_turns.to(torch.int64).contiguous()
    gid = group_ids.to(torch.int64).contiguous()
    ep = torch.empty(n_seq, dtype=torch.float32, device=dev)
    ret = torch.empty(max(n_turns, 1), dtype=torch.float32, device=dev)
    # scores and turn rewards are [B] / [M] values: fp32 copies cost nothing and keep one compiled variant
    _episode_kernel[(n_seq,)](scores.float().contiguous(), gid, cu, turn_rewards.float().contiguous(), ep, ret,
                              n_seq, float(eps), float(step_gamma), NORM=bool(norm_by_std),
                              BLOCK_B=1024 if big else 256)
    if n_turns == 0:
        return out, step, size
    traj = torch.repeat_interleave(torch.arange(n_seq, device=dev), cu.diff(), output_size=n_turns)
    turn_adv = torch.empty(n_turns, dtype=torch.float32, device=dev)
    _step_kernel[(n_turns,)](turn_keys.to(torch.int64).contiguous(), gid[traj].contiguous(), traj, ret, ep, step,
                             size, turn_adv, n_turns, float(eps), float(step_weight), NORM=bool(norm_by_std),
                             BLOCK_M=1024 if big else 256)
    if n_tok:
        block = 1024
        _scatter_kernel[(triton.cdiv(n_tok, block),)](turn_ids.to(torch.int64).contiguous(), _mask_arg(mask),
                                                       turn_adv, out, n_tok, BLOCK=block)
    return out, step, size
