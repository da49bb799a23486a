"""fastpo.kernels public functions: validate inputs, shape them, call the ``fastpo::`` custom ops.

Token tensors are padded ``[B, T]`` or packed ``[N]``; packed inputs pass ``cu_seqlens`` (int ``[B + 1]``,
``cu_seqlens[0] == 0``) wherever sequences matter (sequence-level loss aggregation, GAE, GRPO). ``mask`` marks
trained tokens (bool, or any dtype where nonzero = trained). Every function works on CPU (reference torch) and
CUDA (Triton) tensors, under autograd and under ``torch.compile(fullgraph=True)``; outputs are fp32 whatever
the input dtype. Bad arguments raise ValueError naming the argument, before any kernel runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from . import offpolicy
from . import reference as ref
from .ops import library as lib

LOSS_AGG_MODES = ref.LOSS_AGG_MODES
OFFPOLICY_MODES = offpolicy.OFFPOLICY_MODES
KL_TYPES = {"k1": 0, "kl": 0, "k3": 1, "low_var_kl": 1}


# -------------------------------------------------------------------------------------------- validation
def _tensor(x: object, name: str, kind: str = "float") -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if kind == "float" and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if kind == "int" and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def _same_shape(x: Tensor, name: str, shape: Sequence[int], what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(x.shape)}")


def _same_device(**tensors: Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} must be on {first_name}'s device {first.device}, got {t.device}")


def _number(value: object, name: str, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must lie in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _choice(value: object, name: str, choices: Iterable) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _token_layout(mask: Tensor, cu_seqlens: Tensor | None, name: str = "mask") -> None:
    """mask is [B, T] (cu_seqlens None) or [N] (cu_seqlens int [B + 1] on the same device)."""
    _tensor(mask, name, kind="any")
    if cu_seqlens is None:
        if mask.dim() not in (1, 2):
            raise ValueError(f"{name} must be [B, T] (padded) or [N] (packed), got shape {tuple(mask.shape)}")
        return
    _tensor(cu_seqlens, "cu_seqlens", kind="int")
    if mask.dim() != 1:
        raise ValueError(f"with cu_seqlens, {name} must be packed [N], got shape {tuple(mask.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B + 1], got shape {tuple(cu_seqlens.shape)}")
    _same_device(**{name: mask, "cu_seqlens": cu_seqlens})


def _like(tensors: dict[str, Tensor | None], shape: Sequence[int], what: str) -> None:
    for name, t in tensors.items():
        if t is not None:
            _tensor(t, name, kind="float" if name != "mask" else "any")
            _same_shape(t, name, shape, what)


def _temperature(temperature: float) -> float:
    t = _number(temperature, "temperature", 0.0, math.inf, low_open=True)
    if math.isinf(t):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return t


# ---------------------------------------------------------------------------------------------- logprob
def selective_logprob(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) gathered at ``ids``.

    logits ``[..., V]`` (any float dtype; ``[B, T, V]`` slices such as ``logits[:, :-1]`` are read in place),
    ids ``logits.shape[:-1]`` int in [0, V). Returns fp32 ``ids.shape``; differentiable in logits."""
    _tensor(logits, "logits")
    _tensor(ids, "ids", kind="int")
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
    _same_shape(ids, "ids", logits.shape[:-1], "logits.shape[:-1]")
    if logits.shape[-1] == 0:  # else reported as ids outside [0, 0)
        raise ValueError(f"logits: the vocab is empty (V = 0, the last dim of shape {tuple(logits.shape)}); a "
                         f"logprob needs a vocab of at least one token")
    _same_device(logits=logits, ids=ids)
    t = _temperature(temperature)
    shape = ids.shape
    if logits.dim() > 3:
        logits, ids = logits.flatten(0, -3), ids.flatten(0, -2)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    logp, _ = lib.selective_logprob(logits, ids.contiguous(), t)
    return logp.view(shape)


def fused_linear_logprob(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None = None,
                         temperature: float = 1.0, return_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token logp (and entropy) of ``ids`` under softmax((hidden @ weight.T + bias) / temperature), without
    materialising the N x V logits (forward and backward both tile the vocab).

    hidden ``[..., H]``, weight ``[V, H]`` and bias ``[V]`` of hidden's dtype, ids ``hidden.shape[:-1]`` int in
    [0, V). Returns fp32 ``ids.shape`` logp, or (logp, entropy) with return_entropy; differentiable in hidden,
    weight and bias, through both outputs."""
    _tensor(hidden, "hidden")
    _tensor(weight, "weight")
    _tensor(ids, "ids", kind="int")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got weight "
                         f"shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.shape[0] == 0:  # else reported as ids outside [0, 0), or a division by zero for an empty batch
        raise ValueError(f"weight: the vocab is empty (V = 0 rows, shape {tuple(weight.shape)}); a logprob needs a "
                         f"vocab of at least one token")
    _same_shape(ids, "ids", hidden.shape[:-1], "hidden.shape[:-1]")
    if bias is not None:
        _tensor(bias, "bias")
        _same_shape(bias, "bias", (weight.shape[0],), "[V]")
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    _same_device(hidden=hidden, weight=weight, ids=ids, bias=bias)
    t = _temperature(temperature)
    shape = ids.shape
    logp, entropy, _ = lib.fused_linear_logprob(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight.contiguous(),
        bias.contiguous() if bias is not None else None, ids.reshape(-1).contiguous(), t, bool(return_entropy),
    )
    return (logp.view(shape), entropy.view(shape)) if return_entropy else logp.view(shape)


# ----------------------------------------------------------------------------------------------- losses
def _weights(mask: Tensor, loss_agg_mode: str, cu_seqlens: Tensor | None, norm_len: float | None) -> Tensor:
    _choice(loss_agg_mode, "loss_agg_mode", LOSS_AGG_MODES)
    if norm_len is not None:
        _number(norm_len, "norm_len", 0.0, math.inf, low_open=True)
    if mask.dim() == 1 and cu_seqlens is None and loss_agg_mode != "token-mean":
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} on a packed [N] mask needs cu_seqlens")
    if cu_seqlens is not None and not torch.compiler.is_compiling():
        # the same check the advantage ops run (one host sync); skipped while dynamo traces, where reading the
        # values back would break the graph
        lib.check_cu_seqlens(cu_seqlens, mask.shape[0])
    return ref.aggregation_weights(mask, loss_agg_mode, cu_seqlens, norm_len)


def _per_token(x: Tensor, name: str, shape: Sequence[int]) -> Tensor:
    """A [B] per-sequence tensor broadcast over a padded [B, T] layout, or a tensor of the token shape."""
    _tensor(x, name)
    if len(shape) == 2 and tuple(x.shape) == (shape[0],):
        return x[:, None].expand(shape)
    _same_shape(x, name, shape, "the logp shape, or [B] for a padded layout")
    return x


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor,
                eps_low: float, eps_high: float, clip_c: float, ref_logp: Tensor | None, kl_coef: float,
                kl_type: str, entropy: Tensor | None, entropy_coef: float,
                is_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`ppo_loss` with explicit per-token aggregation weights (fp32, logp's shape): the shared core of
    ppo_loss and the TRL-style modules. is_weight: see :func:`ppo_loss`. Returns (loss fp32 [], stats fp32 [6],
    see ``reference.ppo_loss_fwd``)."""
    _tensor(logp, "logp")
    shape = logp.shape
    advantages = _per_token(advantages, "advantages", shape)
    _like({"old_logp": old_logp, "mask": mask, "ref_logp": ref_logp, "entropy": entropy, "is_weight": is_weight},
          shape, "logp's shape")
    _same_device(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp,
                 entropy=entropy, is_weight=is_weight)
    _number(eps_low, "eps_low", 0.0, 1.0)
    _number(eps_high, "eps_high", 0.0)
    _number(clip_c, "clip_c", 1.0, low_open=True)
    _number(kl_coef, "kl_coef")
    _number(entropy_coef, "entropy_coef")
    _choice(kl_type, "kl_type", KL_TYPES)
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("ref_logp is required when kl_coef != 0 (it is the reference policy's logp)")
    detach = lambda t: t.detach() if t is not None else None
    need_grad = logp.requires_grad and torch.is_grad_enabled()
    loss, stats, _ = lib.ppo_loss(logp, old_logp.detach(), advantages.detach(), weights, mask, detach(ref_logp),
                                  entropy, float(eps_low), float(eps_high), float(clip_c), float(kl_coef),
                                  KL_TYPES[kl_type], float(entropy_coef), need_grad, detach(is_weight))
    return loss, stats


def ppo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float = 0.2,
             eps_high: float = 0.28, clip_c: float = 3.0, loss_agg_mode: str = "token-mean",
             ref_logp: Tensor | None = None, kl_coef: float = 0.0, kl_type: str = "k1",
             entropy: Tensor | None = None, entropy_coef: float = 0.0, *, cu_seqlens: Tensor | None = None,
             norm_len: float | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy loss with dual clip, KL to a reference and an entropy bonus (docs/SEMANTICS.md section 5).

    Per trained token, r = exp(logp - old_logp) (log-ratio clamped to +-20 as verl), l = max(-A r,
    -A clip(r, 1 - eps_low, 1 + eps_high)), and where A < 0, l = min(l, -A clip_c) (clip_c = inf disables
    the dual clip). loss = agg(l) + kl_coef * agg(kl) - entropy_coef * agg(entropy), kl = logp - ref_logp (k1)
    or exp(ref - logp) - (ref - logp) - 1 (k3, alias low_var_kl). agg is loss_agg_mode (see
    ``reference.aggregation_weights``; seq-mean-token-sum-norm divides by norm_len, default T / the longest
    packed sequence). A clip branch is taken only strictly beyond its bound.

    logp ``[B, T]`` or packed ``[N]`` (float, differentiable), old_logp / mask / ref_logp / entropy the same
    shape (entropy differentiable), advantages the same shape or ``[B]`` (padded). Returns (loss fp32 [],
    metrics): masked token means (fp32 0-dim, detached) clipfrac (clipped branch taken), clipfrac_lower (dual
    clip taken), approx_kl (mean old_logp - logp), plus entropy when given and kl when ref_logp is given.

    is_weight: optional per-token off-policy correction c (float, logp's shape, e.g. from
    :func:`offpolicy_weights`; read as a constant): l becomes c * l, the KL and entropy terms and the aggregation
    weights are unchanged (a token with c = 0 still counts in token-mean's denominator), the metrics ignore c.
    None: the uncorrected loss, bit for bit."""
    _tensor(logp, "logp")
    _token_layout(mask, cu_seqlens)
    weights = _weights(mask, loss_agg_mode, cu_seqlens, norm_len)
    loss, stats = policy_loss(logp, old_logp, advantages, mask, weights, eps_low, eps_high, clip_c, ref_logp,
                              kl_coef, kl_type, entropy, entropy_coef, is_weight)
    return loss, ppo_metrics(stats, entropy is not None, ref_logp is not None)


def ppo_metrics(stats: Tensor, has_entropy: bool, has_kl: bool) -> dict[str, Tensor]:
    """The metrics dict of :func:`ppo_loss` from the op's stats vector."""
    stats = stats.detach()
    count = stats[5].clamp(min=1.0)
    metrics = {"clipfrac": stats[0] / count, "clipfrac_lower": stats[1] / count, "approx_kl": stats[2] / count}
    if has_entropy:
        metrics["entropy"] = stats[3] / count
    if has_kl:
        metrics["kl"] = stats[4] / count
    return metrics


def offpolicy_weights(old_logp: Tensor, sample_logp: Tensor, mask: Tensor, mode: str = "tis", cap: float = 2.0,
                      low: float = 0.5, high: float = 2.0, *,
                      cu_seqlens: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Off-policy correction weights for :func:`ppo_loss`'s ``is_weight`` (docs/SEMANTICS.md section 11): per
    trained token, l = clamp(old_logp - sample_logp, +-20), r = exp(l).

    mode ``tis``: w = min(r, cap); ``decoupled`` (AReaL): w = r, or 0 where r > cap; ``mis``: per sequence
    rho = exp(mean of l over its trained tokens) (geometric mean), w = 0 on every token of a sequence with rho
    outside [low, high] (inclusive; compared as log(low) <= mean(l) <= log(high)), else 1; ``none``: w = 1. Off
    the mask w = 1. cap in (1, inf] (inf: no truncation / drop), low in [0, 1), high in (1, inf].

    old_logp, sample_logp: float ``[B, T]`` or packed ``[N]`` (read as constants); mask: the same shape, nonzero =
    a trained token with an exact sampler logprob; cu_seqlens int ``[B + 1]`` for packed ``mis``. Returns (weights
    fp32 of mask's shape, stats of fp32 0-dim tensors: ratio_mean / ratio_max / ratio_min over trained tokens of
    the ratio the mode uses (r, or the token's sequence rho for mis; 1 when no token is trained), clipped_frac
    (share of trained tokens with r > cap: truncated by tis, dropped by decoupled), masked_seq_frac (share of the
    sequences holding a trained token that mis masks), masked_token_frac (share of trained tokens with w = 0)).
    No host sync (beyond the cu_seqlens check, skipped under torch.compile)."""
    _choice(mode, "mode", OFFPOLICY_MODES)
    _tensor(old_logp, "old_logp")
    _token_layout(mask, cu_seqlens)
    _like({"old_logp": old_logp, "sample_logp": sample_logp}, mask.shape, "mask's shape")
    _same_device(mask=mask, old_logp=old_logp, sample_logp=sample_logp, cu_seqlens=cu_seqlens)
    cap = _number(cap, "cap", 1.0, low_open=True)
    low = _number(low, "low")
    if not 0.0 <= low < 1.0:
        raise ValueError(f"low must lie in [0, 1), got {low!r}")
    high = _number(high, "high", 1.0, low_open=True)
    if mode == "mis" and mask.dim() == 1 and cu_seqlens is None:
        raise ValueError("mode='mis' on a packed [N] mask needs cu_seqlens (the ratio is per sequence)")
    if cu_seqlens is not None and not torch.compiler.is_compiling():
        lib.check_cu_seqlens(cu_seqlens, mask.shape[0])
    return offpolicy.offpolicy_weights(old_logp, sample_logp, mask, mode, cap, low, high, cu_seqlens)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.5,
               loss_agg_mode: str = "token-mean", *, cu_seqlens: Tensor | None = None,
               norm_len: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss 0.5 * agg(max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)) (verl).

    values ``[B, T]`` or packed ``[N]`` (differentiable), old_values / returns / mask the same shape. Returns
    (loss fp32 [], {"clipfrac": share of masked tokens where the clipped branch is strictly larger})."""
    _tensor(values, "values")
    _token_layout(mask, cu_seqlens)
    _like({"old_values": old_values, "returns": returns, "mask": mask}, values.shape, "values' shape")
    _same_device(values=values, old_values=old_values, returns=returns, mask=mask)
    _number(clip, "clip", 0.0)
    weights = _weights(mask, loss_agg_mode, cu_seqlens, norm_len)
    need_grad = values.requires_grad and torch.is_grad_enabled()
    loss, stats, _ = lib.value_loss(values, old_values.detach(), returns.detach(), weights, mask, float(clip),
                                    need_grad)
    stats = stats.detach()
    return loss, {"clipfrac": stats[0] / stats[1].clamp(min=1.0)}


# ------------------------------------------------------------------------------------------- advantages
def _advantage_inputs(tensors: dict[str, Tensor], mask: Tensor, cu_seqlens: Tensor | None) -> None:
    _token_layout(mask, cu_seqlens)
    for name, t in tensors.items():
        _tensor(t, name, kind="float" if name in ("rewards", "values") else "any")
        _same_shape(t, name, mask.shape, "mask's shape")
    _same_device(mask=mask, cu_seqlens=cu_seqlens, **tensors)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True, *, cu_seqlens: Tensor | None = None,
                   skip_observations: bool = True) -> tuple[Tensor, Tensor]:
    """Multi-turn GAE (StarPO default estimator) -> fp32 (advantages, returns), 0 on untrained tokens.

    The recursion runs over trained tokens only: observation tokens (mask 0) are skipped, their values never
    read, "next value" is the value at the next trained token (0 after the last). A reward placed on an
    untrained token is credited to the last trained token before it (the action that caused it; rewards before
    the first trained token go to the first one), so no reward is lost. With gamma = lam = 1, A_t = (sum of
    rewards from t on) - V_t on trained tokens. Returns = A + V before whitening; whitening = masked mean / unbiased
    std over the whole batch. rewards / values float, mask any dtype: ``[B, T]`` or packed ``[N]`` + cu_seqlens.

    ``skip_observations=False`` is verl@1e47e41's GAE (what RAGEN runs): the recursion walks every position from
    each sequence's first trained token to its end, reading the values of observation tokens and decaying across
    them; advantages and returns are then kept on trained tokens and whitened there. It equals the default when
    gamma = lam = 1 or when trained tokens are contiguous."""
    _advantage_inputs({"rewards": rewards, "values": values}, mask, cu_seqlens)
    _number(gamma, "gamma", 0.0, 1.0)
    _number(lam, "lam", 0.0, 1.0)
    if not skip_observations:
        def scan(rw: Tensor, vals: Tensor, span: Tensor, g: float, lm: float) -> tuple[Tensor, Tensor]:
            return lib.gae_advantages(rw, vals, span, None, cu_seqlens, float(g), float(lm), False)

        return ref.verl_gae(rewards.detach(), values.detach(), mask, gamma, lam, bool(whiten), cu_seqlens,
                            scan=scan)
    return lib.gae_advantages(rewards.detach(), values.detach(), mask, None, cu_seqlens, float(gamma), float(lam),
                              bool(whiten))


def bilevel_gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, turn_end: Tensor, gamma: float = 1.0,
                           lam: float = 1.0, gamma_high: float = 0.95, lam_high: float | None = None,
                           whiten: bool = True, *, cu_seqlens: Tensor | None = None,
                           turns: str = "turn_end") -> tuple[Tensor, Tensor]:
    """Bi-level GAE (RAGEN): turn-level GAE over turn ends (gamma_high, lam_high, default lam) whose turn
    returns become the reward of each turn's last token in a token-level GAE within the turn (gamma, lam).

    Turn boundaries are explicit: ``turn_end`` (bool/int, mask's shape) flags the last token of each turn (a
    flag on position t separates t from t + 1; it may sit on an observation token; the sequence end always
    closes a turn). Rewards are credited to trained tokens as in :func:`gae_advantages` and summed per turn.
    Returns fp32 (advantages, returns). The packed layout is padded internally (one host sync).

    ``turns="reward"`` finds turns as RAGEN's code does instead (``turn_end`` is then not read): a turn ends at
    every trained token holding a non-zero (credited) reward, and the sequence end closes the last one. With one
    end-of-episode reward that is a single turn, so gamma_high never discounts it: plain GAE (gamma, lam) over
    the trained tokens with the episode return on the last one."""
    _advantage_inputs({"rewards": rewards, "values": values, "turn_end": turn_end}, mask, cu_seqlens)
    for name, value in (("gamma", gamma), ("lam", lam), ("gamma_high", gamma_high)):
        _number(value, name, 0.0, 1.0)
    _choice(turns, "turns", ("turn_end", "reward"))
    lam_high = lam if lam_high is None else _number(lam_high, "lam_high", 0.0, 1.0)
    r, v, m, te = ref.padded_view([rewards.detach(), values.detach(), mask, turn_end], cu_seqlens)
    if turns == "reward":
        te = ref.reward_turn_ends(r, m)

    def scan(rw: Tensor, vals: Tensor, msk: Tensor, g: float, lm: float,
             reset: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return lib.gae_advantages(rw, vals, msk, reset, None, float(g), float(lm), False)

    adv, ret = ref.bilevel_gae_scan(r, v, m, te, gamma, lam, gamma_high, lam_high, scan=scan)
    if whiten:
        adv = ref.masked_whiten(adv, m)
    return ref.unpad((adv, ret), cu_seqlens, mask.shape[0])


def grpo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6,
                    *, cu_seqlens: Tensor | None = None) -> Tensor:
    """GRPO: A_i = (R_i - mean_group) / (std_group + eps) (unbiased std; a group of one gets 0), or R_i - mean
    with norm_by_std=False, broadcast to the trained tokens of sequence i. eps must be > 0 (a group of equal scores
    then gets 0, not 0 / 0).

    scores float ``[B]``, group_ids int ``[B]`` (any labels), mask ``[B, T]`` or packed ``[N]`` + cu_seqlens
    (``[B + 1]``). Returns fp32 of mask's shape."""
    _tensor(scores, "scores")
    _tensor(group_ids, "group_ids", kind="int")
    _token_layout(mask, cu_seqlens)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B] (one score per sequence), got shape {tuple(scores.shape)}")
    _same_shape(group_ids, "group_ids", scores.shape, "scores' shape [B]")
    n_seq = mask.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if n_seq != scores.shape[0]:
        where = "mask.shape[0]" if cu_seqlens is None else "len(cu_seqlens) - 1"
        raise ValueError(f"scores must have one entry per sequence ({where} = {n_seq}), got {scores.shape[0]}")
    _same_device(scores=scores, group_ids=group_ids, mask=mask, cu_seqlens=cu_seqlens)
    _number(eps, "eps", 0.0, low_open=True)  # 0 would divide 0 by 0 (NaN) for a group of equal scores
    return lib.grpo_advantages(scores.detach(), group_ids, mask, cu_seqlens, bool(norm_by_std), float(eps))


def gigpo_advantages(scores: Tensor, group_ids: Tensor, turn_keys: Tensor, turn_rewards: Tensor, cu_turns: Tensor,
                     turn_ids: Tensor, mask: Tensor, step_weight: float = 1.0, step_gamma: float = 0.95,
                     norm_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """GiGPO (Group-in-Group Policy Optimization): per turn, A = episode advantage + step_weight * step advantage,
    on that turn's trained tokens (docs/KERNELS.md has every edge case).

    Episode advantage of trajectory i: (R_i - mean) / (std + eps) over its group (unbiased std; a group of one
    gets 0), or R_i - mean with norm_by_std=False. Step advantage of a turn: the same normalisation of its
    discounted return G_t = r_t + step_gamma * G_{t+1} within its step group (the turns of the same group that start
    from the same state key, at any turn index, both visits when one trajectory comes back to a state); a singleton
    step group gets 0.

    scores float ``[B]``, group_ids int ``[B]`` (any labels); turn_keys int ``[M]`` (key of the state each turn
    starts from; uint64 keys viewed as int64), turn_rewards float ``[M]``, cu_turns int ``[B + 1]`` (trajectory b
    owns turns ``cu_turns[b]:cu_turns[b + 1]``, in order); turn_ids int ``[N]`` (the turn index in ``[0, M)`` of each
    packed token, -1 for tokens outside any turn), mask ``[N]``. Returns (advantages fp32 ``[N]``, 0 on untrained
    tokens and tokens without a turn; step advantages fp32 ``[M]``; step group sizes int64 ``[M]``)."""
    for name, t, kind in (("scores", scores, "float"), ("group_ids", group_ids, "int"), ("turn_keys", turn_keys, "int"),
                          ("turn_rewards", turn_rewards, "float"), ("cu_turns", cu_turns, "int"),
                          ("turn_ids", turn_ids, "int"), ("mask", mask, "any")):
        _tensor(t, name, kind)
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _same_shape(group_ids, "group_ids", scores.shape, "scores' shape [B]")
    _same_shape(turn_rewards, "turn_rewards", turn_keys.shape, "turn_keys' shape [M]")
    _same_shape(turn_ids, "turn_ids", mask.shape, "mask's shape [N]")
    if cu_turns.shape[0] != scores.shape[0] + 1:
        raise ValueError(f"cu_turns must have len(scores) + 1 = {scores.shape[0] + 1} entries, got {cu_turns.shape[0]}")
    _same_device(scores=scores, group_ids=group_ids, turn_keys=turn_keys, turn_rewards=turn_rewards,
                 cu_turns=cu_turns, turn_ids=turn_ids, mask=mask)
    _number(step_weight, "step_weight", 0.0)
    _number(step_gamma, "step_gamma", 0.0, 1.0)
    _number(eps, "eps", 0.0, low_open=True)  # 0 would divide 0 by 0 (NaN) for a group of equal returns
    return lib.gigpo_advantages(scores.detach(), group_ids, turn_keys, turn_rewards.detach(), cu_turns, turn_ids, mask,
                                float(step_weight), float(step_gamma), bool(norm_by_std), float(eps))
