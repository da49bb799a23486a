"""GiGPO in plain torch (the test oracle and the CPU path of ``fastpo.kernels.gigpo_advantages``): episode-level
group advantages plus step-level advantages over anchor states, with the layouts of ``kernels.reference``."""
from __future__ import annotations

import torch
from torch import Tensor


def _group_normalize(x: torch.Tensor, inverse: torch.Tensor, norm_by_std: bool, eps: float) -> tuple:
    """fp64 (x - mean_group) [/ (std_group + eps)] and the group sizes of each element, groups given by inverse
    ([len(x)] in [0, G)); unbiased std, 0 for a group of one (whose deviation is exactly 0)."""
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, inverse, x) / count.clamp(min=1)
    dev = x - mean[inverse]
    if norm_by_std:
        var = torch.zeros_like(count).index_add_(0, inverse, dev * dev) / (count - 1).clamp(min=1)
        dev = dev / (torch.where(count > 1, var.sqrt(), 0.0)[inverse] + eps)
    return dev, count[inverse]


def gigpo_turn_returns(turn_rewards: torch.Tensor, cu_turns: torch.Tensor, gamma: float) -> torch.Tensor:
    """fp64 [M] discounted return of each turn within its trajectory: G_t = r_t + gamma * G_{t+1}, 0 after the
    last turn. turn_rewards float [M], cu_turns int [B + 1] (trajectory b owns turns cu_turns[b]:cu_turns[b + 1])."""
    n_turns = turn_rewards.shape[0]
    lengths = cu_turns.diff()
    traj = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                   output_size=n_turns)
    pos = torch.arange(n_turns, device=lengths.device) - cu_turns[:-1].to(torch.int64)[traj]
    width = int(lengths.max()) if lengths.numel() and n_turns else 0
    padded = torch.zeros(lengths.shape[0], width + 1, dtype=torch.float64, device=turn_rewards.device)
    padded[traj, pos] = turn_rewards.double()
    for k in range(width - 1, -1, -1):  # column `width` stays 0: the return after the last turn
        padded[:, k] += gamma * padded[:, k + 1]
    return padded[traj, pos]


def gigpo_advantages(scores: Tensor, group_ids: Tensor, turn_keys: Tensor, turn_rewards: Tensor, cu_turns: Tensor,
                     turn_ids: Tensor, mask: Tensor, step_weight: float = 1.0, step_gamma: float = 0.95,
                     norm_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """GiGPO (docs/KERNELS.md): per turn, A = episode advantage of its trajectory + step_weight * step advantage.

    scores float [B] (trajectory returns), group_ids int [B]; turn_keys int64 [M] (state each turn starts from),
    turn_rewards float [M], cu_turns int [B + 1]; turn_ids int [N] (the turn of each token, -1 for none), mask [N].
    Episode advantage: (R - mean) [/ (std + eps)] over the trajectories of a group. Step advantage: the same over
    the discounted turn returns (step_gamma) of the turns of one group starting from one state key (0 for a
    singleton). Returns (advantages fp32 [N] on trained tokens with a turn, 0 elsewhere; step advantages fp32 [M];
    step group sizes int64 [M])."""
    n_turns = turn_keys.shape[0]
    _, seq_inv = torch.unique(group_ids, return_inverse=True)
    episode, _ = _group_normalize(scores.double(), seq_inv, norm_by_std, eps)
    traj = torch.repeat_interleave(torch.arange(scores.shape[0], device=scores.device), cu_turns.diff(),
                                   output_size=n_turns)
    returns = gigpo_turn_returns(turn_rewards, cu_turns, step_gamma)
    # step group = (group, key): two 1-D uniques and one of their combination (exact; unique(dim=0) on pairs is
    # ~100x slower on CPU)
    _, key_inv = torch.unique(turn_keys, return_inverse=True)
    pair = seq_inv[traj] * (int(key_inv.max()) + 1 if n_turns else 1) + key_inv
    _, step_inv = torch.unique(pair, return_inverse=True)
    step, size = _group_normalize(returns, step_inv, norm_by_std, eps)
    turn_adv = episode[traj] + step_weight * step
    out = torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device)
    if n_turns:
        tid = turn_ids.to(torch.int64)
        out = torch.where((mask != 0) & (tid >= 0), turn_adv[tid.clamp(min=0)], out)
    return out.float(), step.float(), size.to(torch.int64)
