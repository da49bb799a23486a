"""StarPO / StarPO-S algorithm pieces, each selected by a config string from a small registry (verl / TRL style).

    keep, metrics = filter_groups(scores, group_ids, cfg.rollout_filter_ratio, cfg.rollout_filter_type)  # re-exported
    advantages, returns = compute_advantages(batch, cfg)        # batch: PackedBatch of the kept trajectories
    is_weight, metrics = offpolicy_weights(old_logp, sample_logp, mask, cfg, cu_seqlens=cu)  # None when off
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, entropy, ref_logp, cfg, cu_seqlens=cu,
                                is_weight=is_weight)
    loss, metrics = critic_loss(values, old_values, returns, mask, cfg, cu_seqlens=cu)

Token tensors are packed ``[N]`` (all trajectories concatenated, ``cu_seqlens`` int ``[B + 1]``); per-trajectory
tensors are ``[B]``. The math runs in ``fastpo.kernels`` (Triton on CUDA, reference torch on CPU); this module
only picks the variant and its arguments. Add a variant with ``@register_adv_estimator("name")`` or
``@register_policy_loss("name")``. The rollout filters (fastpo's named ones and RAGEN-2's family) have their one
registry in ``fastpo.rollout_filter``; ``filter_groups``, ``group_stats``, ``kept_group_count`` and
``ROLLOUT_FILTERS`` are re-exported here for the callers that name them through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastpo import kernels
from fastpo.config import AlgorithmConfig
from fastpo.rollout_filter import ROLLOUT_FILTERS, filter_groups, group_stats, kept_group_count  # noqa: F401


@dataclass
class PackedBatch:
    """The trajectories an update trains on, packed without padding (B trajectories, N tokens in all)."""

    token_rewards: Tensor
    """fp32 [N]: reward on the token where it was earned (trajectory level: the sum on the last trained token)."""
    loss_mask: Tensor
    """bool [N]: the model's own (trained) tokens."""
    turn_end: Tensor
    """bool [N]: the last token of each turn (bilevel_gae); the end of a trajectory always closes a turn."""
    cu_seqlens: Tensor
    """int [B + 1]: trajectory i spans tokens cu_seqlens[i]:cu_seqlens[i + 1]; cu_seqlens[0] == 0."""
    scores: Tensor
    """fp32 [B]: trajectory return (sum of rewards and penalties): what grpo / rloo / the filter compare."""
    group_ids: Tensor
    """int [B]: group label (trajectories of one group share an initial state)."""
    values: Tensor | None = None
    """fp32 [N]: critic values (old, detached) for gae / bilevel_gae; None otherwise."""
    turn_keys: Tensor | None = None
    """int64 [M] (gigpo): key of the env state each trained turn starts from (uint64 viewed as int64); trajectory i's
    turns are cu_turns[i]:cu_turns[i + 1], in order."""
    turn_rewards: Tensor | None = None
    """fp32 [M] (gigpo): each turn's reward r_t (env reward of its actions + its format penalty)."""
    cu_turns: Tensor | None = None
    """int [B + 1] (gigpo): turn offsets of the trajectories; cu_turns[0] == 0, cu_turns[B] == M."""
    turn_ids: Tensor | None = None
    """int64 [N] (gigpo): the turn (index into [M]) each token belongs to, -1 for none (see :func:`token_turn_ids`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Filled by estimators that report statistics of their own (gigpo: ``adv/gigpo_*``)."""


AdvantageFn = Callable[[PackedBatch, AlgorithmConfig], "tuple[Tensor, Tensor | None]"]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
_CRITIC_ESTIMATORS: set[str] = set()


def register_adv_estimator(name: str, needs_critic: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register ``fn(batch, cfg) -> (advantages fp32 [N], returns fp32 [N] or None)`` under ``name``;
    ``needs_critic`` estimators read ``batch.values`` and return the critic's targets."""
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        if needs_critic:
            _CRITIC_ESTIMATORS.add(name)
        return fn
    return deco


def needs_critic(cfg: AlgorithmConfig) -> bool:
    """True when cfg.adv_estimator trains and reads a critic (gae, bilevel_gae)."""
    _lookup(ADV_ESTIMATORS, cfg.adv_estimator, "algorithm.adv_estimator")
    return cfg.adv_estimator in _CRITIC_ESTIMATORS


def needs_reference(cfg: AlgorithmConfig) -> bool:
    """True when a reference policy must be loaded and run: only when the KL term is on (kl_coef != 0)."""
    return cfg.kl_coef != 0.0


def _lookup(registry: dict, name: str, field: str):
    if name not in registry:
        raise ValueError(f"{field}: unknown {name!r}; choose from {sorted(registry)}")
    return registry[name]


def compute_advantages(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor | None]:
    """Advantages fp32 [N] (0 on untrained tokens) and returns fp32 [N] (critic estimators) or None.

    After the estimator, RAGEN-2's options (in this order, each a no-op when off): with adv_estimator grpo,
    soft_advantage_reweight (:func:`soft_reweight`) and grpo_length_weight (:func:`length_weight`); then, for
    every estimator, zero_task_advantage sets every advantage to 0 (the critic's returns stay). They run in torch
    around the estimator (the Triton kernels compute the plain estimator)."""
    fn = _lookup(ADV_ESTIMATORS, cfg.adv_estimator, "algorithm.adv_estimator")
    if needs_critic(cfg) and batch.values is None:
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator!r} needs batch.values (the critic's)")
    adv, ret = fn(batch, cfg)
    if cfg.adv_estimator == "grpo" and cfg.soft_advantage_reweight:
        weight = soft_reweight(batch.scores, _grpo_groups(batch.group_ids, cfg.grpo_norm))
        batch.metrics["adv/soft_reweight_mean"] = float(weight.mean()) if weight.numel() else 0.0
        adv = adv * _broadcast(weight, batch)
    if cfg.adv_estimator == "grpo" and cfg.grpo_length_weight:
        adv = adv * _broadcast(length_weight(batch.loss_mask, batch.cu_seqlens), batch)
    if cfg.zero_task_advantage:
        adv = torch.zeros_like(adv)
    return adv, ret


def _grpo_groups(group_ids: Tensor, grpo_norm: str) -> Tensor:
    """The labels grpo normalises within: the groups (group), one batch group (batch), or one per row (none)."""
    if grpo_norm == "batch":
        return torch.zeros_like(group_ids)
    if grpo_norm == "none":
        return torch.arange(group_ids.shape[0], device=group_ids.device)
    return group_ids


def soft_reweight(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RAGEN-2's soft_advantage_reweight: fp32 [B] weight of each trajectory = std of its group's returns /
    (largest group std in the batch + 1e-6). Unbiased std; a group of one counts as std 1 (RAGEN's GRPO
    convention), so a batch of singletons weighs every row 1 / (1 + 1e-6). scores fp32 [B], group_ids int [B].
    Groups with more spread (more to learn from) keep their advantages; flat ones fade towards 0."""
    if scores.numel() == 0:
        return scores.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    g = int(inverse.max()) + 1
    x = scores.double()
    count = torch.bincount(inverse, minlength=g).to(torch.float64)
    mean = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inverse, x) / count
    sq = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0)
    return (std / (std.max() + _GRPO_EPS))[inverse].float()


def length_weight(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """RAGEN-2's grpo_advantage_length_weight: fp32 [B] factor mean(L) / (L_i + 1e-6), L_i = trajectory i's
    trained tokens (loss_mask bool [N], cu_seqlens int [B + 1]); mean over the batch. Longer answers get smaller
    advantages per token, so each trajectory's summed advantage weighs about the same."""
    lengths = torch.zeros(cu_seqlens.shape[0] - 1, dtype=torch.float64, device=loss_mask.device)
    if lengths.numel():
        seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=loss_mask.device), cu_seqlens.diff(),
                                      output_size=loss_mask.shape[0])
        lengths.index_add_(0, seq, (loss_mask != 0).double())
    return (lengths.mean() / (lengths + _GRPO_EPS)).float() if lengths.numel() else lengths.float()


@register_adv_estimator("gae", needs_critic=True)
def gae(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Multi-turn GAE over trained tokens (observation tokens skipped), whitened over the batch; with gamma = lam =
    1, A_t = R - V_t before whitening."""
    return kernels.gae_advantages(batch.token_rewards, batch.values, batch.loss_mask, cfg.gamma, cfg.lam,
                                  whiten=True, cu_seqlens=batch.cu_seqlens,
                                  skip_observations=cfg.gae_skip_observations)


@register_adv_estimator("bilevel_gae", needs_critic=True)
def bilevel_gae(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """RAGEN bi-level GAE: turn-level GAE (gamma_high, lam) over turn ends, token-level GAE (gamma, lam) within
    each turn, whitened. Turns from the env's turn ends, or (bilevel_turns=reward) from non-zero rewards as RAGEN."""
    return kernels.bilevel_gae_advantages(batch.token_rewards, batch.values, batch.loss_mask, batch.turn_end,
                                          cfg.gamma, cfg.lam, cfg.gamma_high, whiten=True,
                                          cu_seqlens=batch.cu_seqlens, turns=cfg.bilevel_turns)


_GRPO_EPS = 1e-6  # verl's epsilon in the std division


@register_adv_estimator("grpo")
def grpo(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, None]:
    """On every trained token of trajectory i, by cfg.grpo_norm: group = (R_i - mean_group) / (std_group + 1e-6),
    unbiased std; batch = the same over the whole batch as one group; none = R_i / (1 + 1e-6) (verl's groups of
    one: mean 0, std 1). norm_adv_by_std false drops the division (group / batch: R_i - mean; none: R_i)."""
    group_ids = batch.group_ids
    if cfg.grpo_norm == "none":
        per_seq = batch.scores.float()
        return _broadcast(per_seq / (1.0 + _GRPO_EPS) if cfg.norm_adv_by_std else per_seq, batch), None
    if cfg.grpo_norm == "batch":
        group_ids = torch.zeros_like(group_ids)
    elif cfg.grpo_norm != "group":
        raise ValueError(f"algorithm.grpo_norm must be 'group', 'batch' or 'none', got {cfg.grpo_norm!r}")
    adv = kernels.grpo_advantages(batch.scores, group_ids, batch.loss_mask, norm_by_std=cfg.norm_adv_by_std,
                                  eps=_GRPO_EPS, cu_seqlens=batch.cu_seqlens)
    return adv, None


@register_adv_estimator("rloo")
def rloo(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, None]:
    """REINFORCE leave-one-out: R_i - mean of the other members of i's group (0 for a group of one), on every
    trained token of trajectory i."""
    scores = batch.scores.float()
    _, inverse = torch.unique(batch.group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    total = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, inverse, scores.double())
    count = torch.bincount(inverse, minlength=n_groups).to(torch.float64)
    n = count[inverse]
    others_mean = (total[inverse] - scores.double()) / (n - 1).clamp(min=1)
    per_seq = torch.where(n > 1, scores.double() - others_mean, 0.0).float()
    return _broadcast(per_seq, batch), None


@register_adv_estimator("reinforce_pp")
def reinforce_pp(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, None]:
    """REINFORCE++ (verl): discounted return-to-go (gamma) on every trained token, whitened over the batch
    (masked mean / unbiased std). Observation tokens are skipped rather than resetting the return (verl resets
    at every mask 0, which drops rewards earned after an observation in multi-turn data)."""
    zeros = torch.zeros_like(batch.token_rewards, dtype=torch.float32)
    adv, _ = kernels.gae_advantages(batch.token_rewards, zeros, batch.loss_mask, cfg.gamma, 1.0, whiten=True,
                                    cu_seqlens=batch.cu_seqlens)
    return adv, None


@register_adv_estimator("gigpo")
def gigpo(batch: PackedBatch, cfg: AlgorithmConfig) -> tuple[Tensor, None]:
    """GiGPO (arXiv 2505.10978): episode-level group advantage of the trajectory + gigpo_step_weight * step-level
    advantage of the turn among the group's turns that start from the same env state (discounted turn returns,
    gigpo_step_gamma), both normalised by gigpo_norm; on each turn's trained tokens. Fills batch.metrics:
    adv/gigpo_nonsingleton_turn_fraction (turns whose step group has >= 2 members), the same over the turns after
    the first (..._later_turn_fraction: states reached again after a move, not the shared initial state),
    adv/gigpo_step_group_size (mean step group size over turns), adv/gigpo_step_abs_mean (mean |step advantage|)."""
    missing = [n for n in ("turn_keys", "turn_rewards", "cu_turns", "turn_ids") if getattr(batch, n) is None]
    if missing:
        raise ValueError(f"algorithm.adv_estimator='gigpo' needs the batch's per-turn data; missing {missing}")
    adv, step, size = kernels.gigpo_advantages(
        batch.scores, batch.group_ids, batch.turn_keys, batch.turn_rewards, batch.cu_turns, batch.turn_ids,
        batch.loss_mask, step_weight=cfg.gigpo_step_weight, step_gamma=cfg.gigpo_step_gamma,
        norm_by_std=cfg.gigpo_norm == "mean_std")
    n = max(size.numel(), 1)
    later = torch.arange(size.numel()) > batch.cu_turns[:-1].repeat_interleave(batch.cu_turns.diff())  # turn >= 1
    batch.metrics.update({"adv/gigpo_nonsingleton_turn_fraction": float((size > 1).sum()) / n,
                          "adv/gigpo_nonsingleton_later_turn_fraction": float((size[later] > 1).sum()) /
                          max(int(later.sum()), 1),
                          "adv/gigpo_step_group_size": float(size.sum()) / n,
                          "adv/gigpo_step_abs_mean": float(step.abs().sum()) / n})
    return adv, None


def token_turn_ids(turn_end: Tensor, cu_seqlens: Tensor, cu_turns: Tensor) -> Tensor:
    """int64 [N]: the turn of each packed token (an index into the [M] turn arrays), -1 in a trajectory without
    turns. Turn k of a trajectory spans the tokens after its (k - 1)-th turn_end up to its k-th (the prompt before the
    first answer belongs to turn 0, the template text after the last turn_end to the last turn). turn_end bool [N],
    cu_seqlens int [B + 1], cu_turns int [B + 1] (trajectory b has cu_turns[b + 1] - cu_turns[b] turns)."""
    n = turn_end.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=turn_end.device)
    lengths = cu_seqlens.diff()
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=turn_end.device), lengths, output_size=n)
    ends = (turn_end != 0).to(torch.int64)
    before = torch.cumsum(ends, 0) - ends  # turn_ends strictly before each token, over the whole batch
    # id = cu_turns[b] + (flags before the token within b), capped at b's last turn; the cap is -1 without turns
    first = cu_turns[:-1].to(torch.int64)
    last = torch.where(cu_turns.diff() > 0, cu_turns[1:].to(torch.int64) - 1, -1)
    table = torch.stack([first - before[cu_seqlens[:-1].clamp(max=n - 1)], last], dim=1)[seq]  # one gather
    return torch.minimum(before + table[:, 0], table[:, 1])


def _broadcast(per_seq: Tensor, batch: PackedBatch) -> Tensor:
    """[B] per-trajectory values -> fp32 [N] on the trained tokens, 0 elsewhere."""
    lengths = batch.cu_seqlens.diff()
    tok = per_seq.repeat_interleave(lengths, output_size=batch.loss_mask.shape[0])
    return torch.where(batch.loss_mask != 0, tok, 0.0).float()


# ------------------------------------------------------------------------------------------------- losses
PolicyLossFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn(logp, old_logp, advantages, mask, entropy, ref_logp, cfg, cu_seqlens, norm_len) ->
    (loss, metrics)`` under ``name`` (algorithm.policy_loss); norm_len: seq-mean-token-sum-norm's divisor or None.
    A loss that supports algorithm.offpolicy_correction also takes ``is_weight`` (fp32 [N], a constant per-token
    factor of its policy-gradient term); it is passed only when the correction is on."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


@register_policy_loss("ppo")
def ppo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor | None,
        ref_logp: Tensor | None, cfg: AlgorithmConfig, cu_seqlens: Tensor | None,
        norm_len: float | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, dict]:
    """Clipped ratio with clip-higher (eps_low / eps_high), dual clip (clip_c), KL to the reference (kl_coef,
    kl_type) and entropy bonus (entropy_coef), aggregated by loss_agg_mode; is_weight (fp32 [N] or None)
    multiplies each token's clipped term (the off-policy correction)."""
    return kernels.ppo_loss(logp, old_logp, advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                            clip_c=cfg.clip_c, loss_agg_mode=cfg.loss_agg_mode, ref_logp=ref_logp,
                            kl_coef=cfg.kl_coef, kl_type=cfg.kl_type, entropy=entropy,
                            entropy_coef=cfg.entropy_coef, cu_seqlens=cu_seqlens, norm_len=norm_len,
                            is_weight=is_weight)


_ACTOR_METRIC_NAMES = {"clipfrac": "actor/pg_clipfrac", "clipfrac_lower": "actor/pg_clipfrac_lower",
                       "approx_kl": "actor/ppo_kl", "entropy": "actor/entropy", "kl": "actor/kl_loss"}


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, entropy: Tensor | None,
                ref_logp: Tensor | None, cfg: AlgorithmConfig, *, cu_seqlens: Tensor | None = None,
                norm_len: float | None = None, is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor loss of cfg.policy_loss.

    logp fp32 [N] (differentiable), old_logp / advantages / ref_logp fp32 [N], mask bool [N], entropy fp32 [N]
    (differentiable) or None, cu_seqlens int [B + 1] (needed by the seq-mean aggregation modes). norm_len: the
    divisor of seq-mean-token-sum-norm (None: the longest sequence here; the trainer passes one constant for the
    whole batch so that micro-batches are weighed alike). ref_logp is
    required when cfg.kl_coef != 0. Returns (loss fp32 [], metrics of detached 0-dim tensors: actor/pg_loss (the
    loss), actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy and actor/kl_loss when given).
    is_weight: the off-policy correction (fp32 [N], :func:`offpolicy_weights`) or None (then the registered loss
    is called exactly as before, so losses without an ``is_weight`` argument keep working)."""
    fn = _lookup(POLICY_LOSSES, cfg.policy_loss, "algorithm.policy_loss")
    extra = {} if is_weight is None else {"is_weight": is_weight}
    loss, raw = fn(logp, old_logp, advantages, mask, entropy, ref_logp, cfg, cu_seqlens, norm_len, **extra)
    metrics = {_ACTOR_METRIC_NAMES.get(k, f"actor/{k}"): v for k, v in raw.items()}
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics


def offpolicy_weights(old_logp: Tensor, sample_logp: Tensor, mask: Tensor, cfg: AlgorithmConfig, *,
                      cu_seqlens: Tensor | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The correction of cfg.offpolicy_correction (docs/SEMANTICS.md section 11): (is_weight fp32
    [N], metrics), or (None, {}) when it is off.

    old_logp fp32 [N]: the trainer's logprobs at the sampling weights (the scoring pass, or the detached logp of
    an on-policy update's forward); sample_logp fp32 [N]: the sampler's (``Trajectory.sample_logprobs``); mask
    bool [N]: the trained tokens whose sample logprobs are exact (the others keep weight 1); cu_seqlens int
    [B + 1]. Metrics (detached 0-dim): actor/is_ratio_mean, actor/is_ratio_max, actor/is_ratio_min,
    actor/is_clipped_frac, actor/is_masked_seq_frac, actor/is_masked_token_frac."""
    if cfg.offpolicy_correction == "none":
        return None, {}
    weights, stats = kernels.functional.offpolicy_weights(
        old_logp, sample_logp, mask, cfg.offpolicy_correction, cfg.is_cap, cfg.is_mask_low, cfg.is_mask_high,
        cu_seqlens=cu_seqlens)
    return weights, {f"actor/is_{k}": v for k, v in stats.items()}


def critic_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cfg: AlgorithmConfig, *,
                cu_seqlens: Tensor | None = None, norm_len: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss 0.5 * agg(max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)), agg = loss_agg_mode.

    values fp32 [N] (differentiable), old_values / returns fp32 [N], mask bool [N]. Returns (loss fp32 [],
    {critic/vf_loss, critic/vf_clipfrac})."""
    loss, raw = kernels.value_loss(values, old_values, returns, mask, clip=cfg.value_clip,
                                   loss_agg_mode=cfg.loss_agg_mode, cu_seqlens=cu_seqlens, norm_len=norm_len)
    return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": raw["clipfrac"]}
