"""Plain fp64 truths the kernel tests compare against, written independently of fastpo.kernels: matmul ->
log_softmax -> gather, per-position Python loops for the advantage estimators, a dict walk for GRPO and the
PPO / value / TRL formulas token by token. Slow by design; use small shapes."""

from collections import defaultdict

import torch


def logprob_truth(hidden, weight, ids, bias=None, temperature=1.0):
    """fp64 (logp, entropy) of ids under softmax((hidden @ weight.T + bias) / temperature)."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    return logits_logprob_truth(logits, ids, temperature)


def logits_logprob_truth(logits, ids, temperature=1.0):
    logsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logsm.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _credit(rewards_row, trained, length):
    """Reward credited to each trained position: a reward at t goes to the last trained position <= t
    (the first trained position when none)."""
    credit = {p: 0.0 for p in trained}
    j = -1
    for t in range(length):
        while j + 1 < len(trained) and trained[j + 1] <= t:
            j += 1
        credit[trained[max(j, 0)]] += float(rewards_row[t])
    return credit


def gae_loop(rewards, values, mask, gamma, lam):
    """Un-whitened multi-turn GAE, one row and one position at a time (fp64 lists)."""
    rows, length = mask.shape
    adv = torch.zeros(rows, length, dtype=torch.float64)
    ret = torch.zeros(rows, length, dtype=torch.float64)
    for b in range(rows):
        trained = [t for t in range(length) if mask[b, t]]
        if not trained:
            continue
        credit = _credit(rewards[b].tolist(), trained, length)
        last, next_value = 0.0, 0.0
        for p in reversed(trained):
            v = float(values[b, p])
            delta = credit[p] + gamma * next_value - v
            last = delta + gamma * lam * last
            adv[b, p], ret[b, p] = last, last + v
            next_value = v
    return adv, ret


def bilevel_gae_loop(rewards, values, mask, turn_end, gamma, lam, gamma_high, lam_high):
    """Un-whitened bi-level GAE, loops over rows, turns and positions."""
    rows, length = mask.shape
    adv = torch.zeros(rows, length, dtype=torch.float64)
    ret = torch.zeros(rows, length, dtype=torch.float64)
    for b in range(rows):
        trained = [t for t in range(length) if mask[b, t]]
        if not trained:
            continue
        turns, cur = [], []
        for i, p in enumerate(trained):
            cur.append(p)
            nxt = trained[i + 1] if i + 1 < len(trained) else length
            if i + 1 == len(trained) or any(bool(turn_end[b, u]) for u in range(p, nxt)):
                turns.append(cur)
                cur = []
        credit = _credit(rewards[b].tolist(), trained, length)
        turn_return = {}
        last, next_value = 0.0, 0.0
        for turn in reversed(turns):
            end = turn[-1]
            v = float(values[b, end])
            delta = sum(credit[p] for p in turn) + gamma_high * next_value - v
            last = delta + gamma_high * lam_high * last
            turn_return[end] = last + v
            next_value = v
        for turn in turns:
            last, next_value = 0.0, 0.0
            for p in reversed(turn):
                v = float(values[b, p])
                r = turn_return[p] if p == turn[-1] else 0.0
                delta = r + gamma * next_value - v
                last = delta + gamma * lam * last
                adv[b, p], ret[b, p] = last, last + v
                next_value = v
    return adv, ret


def whiten_truth(x, mask, eps=1e-8):
    vals = [float(x[idx]) for idx in zip(*torch.nonzero(mask, as_tuple=True), strict=True)]
    out = torch.zeros_like(x, dtype=torch.float64)
    if not vals:
        return out
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    m = mask.bool()
    out[m] = (x[m].double() - mean) / (var + eps) ** 0.5
    return out


def grpo_dict(scores, group_ids, norm_by_std=True, eps=1e-6):
    """Per-sequence GRPO advantages via a dict of groups (verl's formulation, except size-1 groups -> 0)."""
    groups = defaultdict(list)
    for i, g in enumerate(group_ids.tolist()):
        groups[g].append(float(scores[i]))
    out = torch.zeros(len(scores), dtype=torch.float64)
    for i, g in enumerate(group_ids.tolist()):
        vals = groups[g]
        mean = sum(vals) / len(vals)
        if len(vals) == 1:
            out[i] = 0.0
            continue
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
        out[i] = (float(scores[i]) - mean) / (std + eps) if norm_by_std else float(scores[i]) - mean
    return out


def ppo_per_token(logp, old, adv, eps_low, eps_high, clip_c, ref=None, kl_type="k1"):
    """Per-token PPO loss (dual clip for A < 0) and KL, differentiable in logp; fp64 in, fp64 out."""
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_c), pg)
    kl = None
    if ref is not None:
        kl = logp - ref if kl_type == "k1" else torch.exp(ref - logp) - (ref - logp) - 1
    return pg, kl


def aggregate(x, mask, mode, norm_len=None):
    """verl's agg_loss, with empty rows counting as 0 (padded [B, T])."""
    m = mask.double()
    if mode == "token-mean":
        return (x * m).sum() / max(m.sum().item(), 1.0)
    if mode == "seq-mean-token-sum":
        return (x * m).sum(1).mean()
    if mode == "seq-mean-token-mean":
        return ((x * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (x * m).sum() / (norm_len or mask.shape[-1])
    raise AssertionError(mode)
