"""Off-policy correction weights for the PPO policy loss (plain torch; the CPU path and the only implementation).

The sampler (vLLM, a bf16 engine, a rollout spanning weight versions) draws tokens from pi_sampler, while PPO's
old logprobs pi_old come from the trainer's own forward. The weights below reweigh or drop each trained token's
clipped policy-gradient term by how far the two disagree; ``ops/library.py``'s ``fastpo::ppo_loss`` multiplies
them in (argument ``is_weight``). Nothing here needs a kernel: a few elementwise ops and one segment sum per batch,
no host sync. Formulas and the choices behind them: docs/SEMANTICS.md section 11.

Per trained token t, l_t = clamp(old_logp_t - sample_logp_t, +-20) (the PPO log-ratio clamp) and r_t = exp(l_t):

* ``tis`` (truncated IS, token level): w_t = min(r_t, cap).
* ``decoupled`` (AReaL's decoupled PPO; old_logp is the proximal policy): w_t = r_t where r_t <= cap, else 0
  (AReaL drops a token whose behaviour weight exceeds the cap instead of truncating it).
* ``mis`` (masked IS, sequence level): per sequence the geometric mean rho = exp(mean of l_t over its trained
  tokens); every token of a sequence with rho outside [low, high] gets w = 0, the others w = 1. The bounds are
  compared in the log domain, log(low) <= mean(l) <= log(high), so a ratio exactly at a bound is kept.
* ``none``: w = 1 (the statistics are still computed).

Off the mask w = 1: the loss ignores untrained tokens anyway, and a caller can leave tokens without an exact
sampler logprob uncorrected by leaving them out of ``mask``.
"""

from __future__ import annotations

import math

import torch

from .reference import LOG_RATIO_CLAMP, sequence_index

OFFPOLICY_MODES = ("none", "tis", "mis", "decoupled")
STAT_NAMES = ("ratio_mean", "ratio_max", "ratio_min", "clipped_frac", "masked_seq_frac", "masked_token_frac")


def _sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor,
                        cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(mean log-ratio per sequence [B], trained tokens per sequence [B], sequence id of each token or None).
    Padded [B, T]: rows are sequences. Packed [N]: cu_seqlens; tokens past cu_seqlens[-1] belong to no sequence
    (id B)."""
    if cu_seqlens is None:
        count = m.sum(-1).float()
        return log_ratio.sum(-1) / count.clamp(min=1.0), count, None
    n_seq = cu_seqlens.shape[0] - 1
    seq = sequence_index(cu_seqlens, m.shape[0])
    total = torch.zeros(n_seq + 1, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seq, log_ratio)
    count = torch.zeros(n_seq + 1, dtype=torch.float32, device=m.device).index_add_(0, seq, m.float())
    return (total / count.clamp(min=1.0))[:n_seq], count[:n_seq], seq


def offpolicy_weights(old_logp: torch.Tensor, sample_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                      cap: float = 2.0, low: float = 0.5, high: float = 2.0,
                      cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token correction weights and their statistics (see the module docstring for the formulas).

    old_logp, sample_logp: float, padded ``[B, T]`` or packed ``[N]`` (any float dtype; computed in fp32); mask:
    the same shape, nonzero = a trained token with an exact sampler logprob; cu_seqlens: int ``[B + 1]`` for a
    packed layout (needed by ``mis`` only). cap > 1 (inf: no truncation / no drop), 0 <= low < 1 < high (inf: no
    upper bound). Inputs are read as constants (no gradient flows into the weights).

    Returns (weights fp32 of mask's shape, stats): fp32 0-dim tensors ``ratio_mean`` / ``ratio_max`` /
    ``ratio_min`` over trained tokens of the ratio the mode uses (r_t; for ``mis`` each token carries its
    sequence's rho), 1 when no token is trained; ``clipped_frac``: share of trained tokens with r_t > cap
    (``tis``: truncated, ``decoupled``: dropped; 0 otherwise); ``masked_seq_frac``: share of the sequences
    holding a trained token that ``mis`` masks; ``masked_token_frac``: share of trained tokens whose weight is 0.
    """
    m = mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    log_ratio = torch.where(m, old_logp.detach().float() - sample_logp.detach().float(), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    one = torch.ones((), dtype=torch.float32, device=m.device)
    over = m & (ratio > cap)
    n_tok = m.sum().float()
    masked_seq_frac = zero
    if mode == "tis":
        weights = torch.where(m, torch.minimum(ratio, torch.full_like(ratio, cap)), one)
    elif mode == "decoupled":
        weights = torch.where(m, torch.where(over, zero, ratio), one)
    elif mode == "mis":
        seq_log, count, seq = _sequence_log_ratio(log_ratio, m, cu_seqlens)
        # log(0) = -inf keeps every sequence below; a sequence without trained tokens has mean 0 and is kept
        log_low = math.log(low) if low > 0 else -math.inf
        keep = (seq_log >= log_low) & (seq_log <= math.log(high))
        has_tokens = count > 0
        masked_seq_frac = (~keep & has_tokens).sum().float() / has_tokens.sum().float().clamp(min=1.0)
        if seq is None:
            keep_tok, seq_rho = keep[:, None].expand(m.shape), torch.exp(seq_log)[:, None].expand(m.shape)
        else:  # tokens past the last sequence (id B) have no sequence: kept, rho 1
            keep_tok = torch.cat([keep, keep.new_ones(1)])[seq]
            seq_rho = torch.cat([torch.exp(seq_log), one[None]])[seq]
        weights = torch.where(m & ~keep_tok, zero, one)
        ratio = seq_rho
        over = torch.zeros_like(m)
    elif mode == "none":
        weights = torch.ones(m.shape, dtype=torch.float32, device=m.device)
        over = torch.zeros_like(m)
    else:
        raise ValueError(f"mode must be one of {OFFPOLICY_MODES}, got {mode!r}")
    big = torch.full((), math.inf, device=m.device)
    stats = {
        "ratio_mean": torch.where(n_tok > 0, torch.where(m, ratio, zero).sum() / n_tok.clamp(min=1.0), one),
        "ratio_max": torch.where(n_tok > 0, torch.where(m, ratio, -big).max() if m.numel() else one, one),
        "ratio_min": torch.where(n_tok > 0, torch.where(m, ratio, big).min() if m.numel() else one, one),
        "clipped_frac": over.sum().float() / n_tok.clamp(min=1.0),
        "masked_seq_frac": masked_seq_frac,
        "masked_token_frac": (m & (weights == 0)).sum().float() / n_tok.clamp(min=1.0),
    }
    return weights, stats
