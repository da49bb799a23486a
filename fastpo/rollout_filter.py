"""The one rollout-filter registry: RAGEN-2's family as pure functions (score each group, pick groups by a strategy,
count empty steps), fastpo's named filters as presets of it, and the batch adjustment after the filter.

    keep, metrics = select_groups(rewards, group_ids, strategy="top_p", value=0.9, include_zero=False)
    keep, metrics = filter_groups(rewards, group_ids, 0.25, "std")             # a named preset (StarPO-S)
    scale = filter_loss_scale(metrics["rollout/kept_group_fraction"], "sqrt")   # multiplies the advantages
    if stopper.update(bool(keep.any())): ...                                    # EmptyStop(steps=5)
    kept = adjust_batch(kept, divisor=32, mode="copy", rng=rng)                 # RAGEN-2's batch_adjust_mode

Why: StarPO-S kept a fixed share of the groups with the highest in-group reward std (``algorithms.filter_groups``).
RAGEN-2 generalises this: a per-group *metric* (reward std, mean or sum, policy entropy mean or std, length), a
*strategy* that turns the scores into a kept set (nucleus-style ``top_p`` with a linear or softmax mass rule,
fractional ``top_k``, absolute ``top_k_abs``, ``min_p`` relative to the best score), a *direction* (keep the largest
or the smallest scores) and the option to drop zero-score groups before selecting (a group whose rewards are all
equal has zero GRPO advantage, so it only adds noise). Its defaults (top_p, value 1, include_zero) keep every group.

Conventions (as ``algorithms.filter_groups``): per-trajectory inputs are [B] in any order, group ids any integer
labels; the result is keep bool [B] (every member of a kept group or none). Groups are handled in ascending
group-id order and every ordering is a stable sort, so equal scores go to the lower group id, and the same input
always gives the same output (RAGEN's ``topk`` / ``sort`` leave ties unspecified). Selection arithmetic is float32
on the fp32 group scores, as RAGEN's (its 1e-10 slacks and boundary cases then agree with it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

ZERO_TOL = 1e-10
"""A group score with ``abs(score) <= ZERO_TOL`` is "zero" for ``include_zero`` (RAGEN's tolerance)."""


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-group statistics of scores [B] by group_ids [B]: (unique ids [G] ascending, inverse [B] (group index of
    each trajectory), std fp32 [G] (unbiased; 0 for a group of one), mean fp32 [G], max fp32 [G])."""
    ids, inverse = torch.unique(group_ids, sorted=True, return_inverse=True)
    g = ids.shape[0]
    x = scores.double()
    count = torch.bincount(inverse, minlength=g).to(torch.float64)
    mean = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inverse, x) / count
    sq = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 0.0)
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64, device=x.device).scatter_reduce_(0, inverse, x, "amax")
    return ids, inverse, std.float(), mean.float(), gmax.float()


# ------------------------------------------------------------------------------------------------ metrics
MetricFn = Callable[[Tensor, Tensor], Tensor]
FILTER_METRICS: dict[str, tuple[MetricFn, str]] = {}
"""name -> (fn(values fp32 [B], group_ids [B]) -> score fp32 [G] in ascending group-id order, the input it reads)."""
METRIC_ALIASES = {"reward_std": "reward_variance", "entropy_std": "entropy_variance"}  # RAGEN's accepted aliases
_INPUTS = ("rewards", "entropies", "lengths")


def register_filter_metric(name: str, reads: str = "rewards") -> Callable[[MetricFn], MetricFn]:
    """Decorator: register a group score computed from one per-trajectory input (``rewards``, ``entropies`` or
    ``lengths``, all fp32 [B])."""
    if reads not in _INPUTS:
        raise ValueError(f"register_filter_metric: reads={reads!r}; choose from {list(_INPUTS)}")

    def deco(fn: MetricFn) -> MetricFn:
        if name in FILTER_METRICS or name in METRIC_ALIASES:
            raise ValueError(f"rollout filter metric {name!r} is already registered")
        FILTER_METRICS[name] = (fn, reads)
        return fn
    return deco


def _std(values: Tensor, group_ids: Tensor) -> Tensor:
    return group_stats(values, group_ids)[2]


def _mean(values: Tensor, group_ids: Tensor) -> Tensor:
    return group_stats(values, group_ids)[3]


# RAGEN names it "variance" but scores by the unbiased std (0 here for a group of one; RAGEN's torch.std gives NaN)
register_filter_metric("reward_variance")(_std)
register_filter_metric("reward")(_mean)  # in-group mean return
register_filter_metric("entropy", reads="entropies")(_mean)  # in-group mean of the per-trajectory token entropy
register_filter_metric("entropy_variance", reads="entropies")(_std)
register_filter_metric("length", reads="lengths")(_mean)  # in-group mean trained-token count


@register_filter_metric("reward_sum")
def _sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """In-group sum of the returns (float64 accumulation, as group_stats)."""
    ids, inverse = torch.unique(group_ids, sorted=True, return_inverse=True)
    out = torch.zeros(ids.shape[0], dtype=torch.float64, device=values.device)
    return out.index_add_(0, inverse, values.double()).float()


# --------------------------------------------------------------------------------------------- strategies
StrategyFn = Callable[..., Tensor]
FILTER_STRATEGIES: dict[str, StrategyFn] = {}
"""name -> fn(score fp32 [C] (the candidate groups, ascending id), *, num_groups, value, largest, prob_mode,
selection_eps) -> keep bool [C]."""
PROB_MODES = ("linear", "softmax")
FILTER_TYPES = ("largest", "smallest")


def register_filter_strategy(name: str) -> Callable[[StrategyFn], StrategyFn]:
    """Decorator: register a selection strategy (the signature in FILTER_STRATEGIES' doc)."""
    def deco(fn: StrategyFn) -> StrategyFn:
        if name in FILTER_STRATEGIES:
            raise ValueError(f"rollout filter strategy {name!r} is already registered")
        FILTER_STRATEGIES[name] = fn
        return fn
    return deco


def _order(score: Tensor, largest: bool) -> Tensor:
    """Candidate positions, best first; stable, so equal scores keep ascending group-id order."""
    return torch.sort(score, descending=largest, stable=True).indices


def _first(order: Tensor, k: int, n: int) -> Tensor:
    keep = torch.zeros(n, dtype=torch.bool, device=order.device)
    keep[order[:k]] = True
    return keep


def _count(k: int, n: int) -> int:
    """RAGEN's count clamp: at most the n candidates, at least one when there is any."""
    return max(min(k, n), 1) if n else 0


@register_filter_strategy("top_p")
def top_p(score: Tensor, *, num_groups: int, value: float, largest: bool, prob_mode: str,
          selection_eps: float) -> Tensor:
    """Nucleus-style: value >= 1 keeps every candidate. ``linear``: walk the candidates best first, adding scores
    while the running sum is below value * sum(candidate scores) - selection_eps and the next score is > 0; keep the
    walked groups if the running sum reached that threshold, else none. So a zero (or negative) score is never kept,
    an all-zero batch keeps nothing, and eps lets a near-zero total keep nothing rather than its noise.
    ``softmax``: p = softmax(score) (of -score for smallest); keep the fewest best groups whose cumulative p reaches
    value (at least one). The raw scores are the logits (temperature 1), so small scores give near-uniform p."""
    n = score.numel()
    if value >= 1.0 or n == 0:
        return torch.ones(n, dtype=torch.bool, device=score.device)
    order = _order(score, largest)
    if prob_mode == "softmax":
        probs = torch.softmax(score if largest else -score, dim=0)[order]
        return _first(order, min(int((probs.cumsum(0) < value).sum()) + 1, n), n)
    threshold = np.float32(float(value * score.sum() - selection_eps))  # fp32 ops, as RAGEN
    total, k = 0.0, 0  # accumulated in float64, compared in float32 (as RAGEN)
    for s in score[order].tolist():
        if np.float32(total) >= threshold or s <= 0:
            break
        total, k = total + s, k + 1
    return _first(order, k if np.float32(total) >= threshold else 0, n)


@register_filter_strategy("top_k")
def top_k(score: Tensor, *, num_groups: int, value: float, largest: bool, **_) -> Tensor:
    """Keep the int(value * num_groups) best candidates (num_groups counts every group, zero-score ones too), at
    most the candidates, at least one; +1e-9 so 0.29 * 100 keeps 29 (fastpo's kept_group_count; RAGEN: 28)."""
    k = num_groups if value >= 1.0 else int(value * num_groups + 1e-9)
    return _first(_order(score, largest), _count(k, score.numel()), score.numel())


@register_filter_strategy("top_k_abs")
def top_k_abs(score: Tensor, *, value: float, largest: bool, **_) -> Tensor:
    """Keep the int(value) best candidates (at most the candidates, at least one): a fixed group count."""
    return _first(_order(score, largest), _count(int(value), score.numel()), score.numel())


@register_filter_strategy("min_p")
def min_p(score: Tensor, *, value: float, largest: bool, **_) -> Tensor:
    """largest: keep score >= value * max(score); smallest: keep score <= min(score) / value (1e-10 slack on both,
    as RAGEN). Meant for non-negative scores: with a negative max (min) it can keep nothing, as RAGEN's does."""
    if score.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=score.device)
    if largest:
        return score >= score.max() * value - 1e-10
    return score <= score.min() / (value + 1e-10) + 1e-10


# ------------------------------------------------------------------------------------------------ checks
def check_filter_args(strategy: str, value: float, metric: str, filter_type: str = "largest",
                      prob_mode: str = "linear", selection_eps: float = 0.01, include_zero: bool = True) -> str:
    """Validate a filter configuration without data (preflight.validate calls it); returns the canonical metric
    name (aliases resolved). Raises ValueError with one line naming the bad value and what is accepted."""
    if strategy not in FILTER_STRATEGIES:
        raise ValueError(f"rollout_filter_strategy: unknown {strategy!r}; choose from {sorted(FILTER_STRATEGIES)}")
    canonical = METRIC_ALIASES.get(metric, metric)
    if canonical not in FILTER_METRICS:
        raise ValueError(f"rollout_filter_metric: unknown {metric!r}; choose from "
                         f"{sorted([*FILTER_METRICS, *METRIC_ALIASES])}")
    if filter_type not in FILTER_TYPES:
        raise ValueError(f"rollout_filter_type: unknown {filter_type!r}; choose from {list(FILTER_TYPES)}")
    if prob_mode not in PROB_MODES:
        raise ValueError(f"rollout_filter_top_p_prob_mode: unknown {prob_mode!r}; choose from {list(PROB_MODES)}")
    if not isinstance(include_zero, bool):
        raise ValueError(f"rollout_filter_include_zero must be a bool, got {include_zero!r}")
    if isinstance(selection_eps, bool) or not (isinstance(selection_eps, (int, float)) and
                                               math.isfinite(selection_eps) and selection_eps >= 0):
        raise ValueError(f"rollout_filter_selection_eps must be a finite number >= 0, got {selection_eps!r}")
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ValueError(f"rollout_filter_value must be a finite number, got {value!r}")
    if strategy == "top_k_abs":
        if value < 1 or value != int(value):
            raise ValueError(f"rollout_filter_value for top_k_abs is a group count: a whole number >= 1, got {value}")
    elif strategy in ("top_p", "top_k", "min_p") and not 0 < value <= 1:
        raise ValueError(f"rollout_filter_value for {strategy} must lie in (0, 1], got {value}")
    return canonical


def _per_trajectory(name: str, x: Tensor | None, shape: torch.Size, metric: str | None = None) -> None:
    if x is None:
        raise ValueError(f"rollout_filter_metric={metric!r} needs {name} (fp32 [B]); got None")
    if x.shape != shape or not x.is_floating_point() or not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be a finite floating tensor of shape {tuple(shape)}, got "
                         f"{x.dtype} {tuple(x.shape)}" + ("" if x.shape != shape else " with non-finite entries"))


# ---------------------------------------------------------------------------------------------- selection
def select_groups(rewards: Tensor, group_ids: Tensor, *, strategy: str = "top_p", value: float = 1.0,
                  metric: str = "reward_variance", filter_type: str = "largest", include_zero: bool = True,
                  prob_mode: str = "linear", selection_eps: float = 0.01, entropies: Tensor | None = None,
                  lengths: Tensor | None = None, max_groups: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """Pick whole groups for the update, RAGEN-2 style. Defaults are RAGEN's base.yaml (keep every group).

    Args:
        rewards: fp32 [B], B >= 1, finite: each trajectory's return (``Trajectory.reward``).
        group_ids: integer [B]: group labels, any values, any order.
        strategy: a FILTER_STRATEGIES name: top_p | top_k | top_k_abs | min_p (see each function).
        value: top_p: the mass in (0, 1] (1 keeps every candidate); top_k: the share of groups in (0, 1];
            top_k_abs: the group count, a whole number >= 1; min_p: the fraction of the best score, in (0, 1].
        metric: a FILTER_METRICS name (or alias reward_std / entropy_std): reward_variance (in-group std of the
            returns), reward (mean), reward_sum, entropy (mean of ``entropies``), entropy_variance (their std),
            length (mean of ``lengths``).
        filter_type: largest (keep high scores) | smallest (keep low scores).
        include_zero: False drops groups whose score is zero (abs <= ZERO_TOL) before the strategy runs; they are
            then never kept. True leaves them as candidates (top_k can then pick them; linear top_p never does).
        prob_mode: top_p only: linear (score-mass rule) | softmax (probability-mass rule).
        selection_eps: linear top_p only, finite >= 0: subtracted from the mass threshold.
        entropies: fp32 [B] or None: per-trajectory mean token entropy over the trained tokens (entropy metrics).
        lengths: fp32 [B] or None: per-trajectory trained-token count (length metric).
        max_groups: None, or an int >= 1: keep at most this many of the selected groups, the lowest group ids
            (dynamic sampling's cap on a data-dependent filter; the metrics describe the capped set).

    Returns keep bool [B] (may be all False: the caller skips the update and ticks an EmptyStop) and metrics:
    ``rollout/in_group_{std,mean,max}`` of the returns over all groups and ``rollout/chosen_in_group_*`` over the
    kept ones (0 when none), ``rollout/kept_group_fraction`` (kept / all groups: RAGEN's filter_kept_ratio, the
    loss-scaling input), ``rollout/filter_kept_count``, ``rollout/filter_zero_count`` (zero-score groups),
    ``rollout/filter_score_mean`` and ``rollout/chosen_filter_score_mean`` (the metric's group scores).
    """
    metric = check_filter_args(strategy, value, metric, filter_type, prob_mode, selection_eps, include_zero)
    if rewards.dim() != 1 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must be a non-empty [B] tensor, got shape {tuple(rewards.shape)}")
    _per_trajectory("rewards", rewards, rewards.shape)
    if group_ids.shape != rewards.shape or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor of shape {tuple(rewards.shape)}, got "
                         f"{group_ids.dtype} {tuple(group_ids.shape)}")
    fn, reads = FILTER_METRICS[metric]
    inputs = {"rewards": rewards, "entropies": entropies, "lengths": lengths}
    if reads != "rewards":
        _per_trajectory(reads, inputs[reads], rewards.shape, metric)
    score = fn(inputs[reads].float(), group_ids)
    _, inverse, std, mean, gmax = group_stats(rewards, group_ids)
    g = score.shape[0]
    zero = score.abs() <= ZERO_TOL
    cand = torch.arange(g, device=score.device) if include_zero else (~zero).nonzero().squeeze(-1)
    picked = FILTER_STRATEGIES[strategy](score[cand], num_groups=g, value=float(value),
                                         largest=filter_type == "largest", prob_mode=prob_mode,
                                         selection_eps=float(selection_eps))
    keep_group = torch.zeros(g, dtype=torch.bool, device=score.device)
    keep_group[cand[picked]] = True
    if max_groups is not None:
        if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
            raise ValueError(f"max_groups must be None or an int >= 1, got {max_groups!r}")
        keep_group &= torch.cumsum(keep_group.long(), 0) <= max_groups  # ascending group id
    metrics = {}
    for name, stat in (("std", std), ("mean", mean), ("max", gmax)):
        metrics[f"rollout/in_group_{name}"] = float(stat.mean())
        chosen = stat[keep_group]
        metrics[f"rollout/chosen_in_group_{name}"] = float(chosen.mean()) if chosen.numel() else 0.0
    kept = int(keep_group.sum())
    metrics.update({"rollout/kept_group_fraction": kept / g, "rollout/filter_kept_count": float(kept),
                    "rollout/filter_zero_count": float(zero.sum()), "rollout/filter_score_mean": float(score.mean()),
                    "rollout/chosen_filter_score_mean": float(score[keep_group].mean()) if kept else 0.0})
    return keep_group[inverse], metrics


# ------------------------------------------------------------------------------------ named filter presets
ROLLOUT_FILTERS: dict[str, dict] = {}
"""algorithm.rollout_filter_type name -> the select_groups keywords it stands for (std / std_rev also take
value = rollout_filter_ratio). fastpo's StarPO-S filters are presets of the family above, so every filter runs
through the same strategies and metrics. RAGEN's pre-2 filter (rollout_filter_ratio r + rollout_filter_type
largest / smallest) is the same top_k with value r."""
LEGACY_FILTERS = ROLLOUT_FILTERS  # the name the porter and older callers use


def register_rollout_filter(name: str, **keywords) -> None:
    """Register a named preset: ``keywords`` are select_groups keywords (strategy, metric, filter_type,
    include_zero, value, ...); a preset without ``value`` takes rollout_filter_ratio as its value."""
    if name in ROLLOUT_FILTERS:
        raise ValueError(f"rollout filter {name!r} is already registered")
    check_filter_args(keywords.get("strategy", "top_p"), keywords.get("value", 1.0),
                      keywords.get("metric", "reward_variance"), keywords.get("filter_type", "largest"),
                      keywords.get("prob_mode", "linear"), keywords.get("selection_eps", 0.01),
                      keywords.get("include_zero", True))
    ROLLOUT_FILTERS[name] = dict(keywords)


# StarPO-S: the int(ratio * G) groups with the highest in-group reward std (the most uncertain)
register_rollout_filter("std", strategy="top_k", filter_type="largest", include_zero=True, metric="reward_variance")
# the ablation: the int(ratio * G) groups with the lowest in-group reward std
register_rollout_filter("std_rev", strategy="top_k", filter_type="smallest", include_zero=True,
                        metric="reward_variance")
# every group whose returns are not all equal (std > ZERO_TOL); the ratio is not used; may keep no group
register_rollout_filter("nonzero", strategy="top_p", value=1.0, include_zero=False, metric="reward_variance")


def legacy_filter_args(kind: str, ratio: float) -> dict:
    """select_groups keywords of the preset ``kind`` (std | std_rev | nonzero | a registered name) at
    rollout_filter_ratio ``ratio`` in (0, 1] (unused by presets that fix their own value)."""
    if kind not in ROLLOUT_FILTERS:
        raise ValueError(f"rollout_filter_type: unknown legacy filter {kind!r}; choose from {sorted(ROLLOUT_FILTERS)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"rollout_filter_ratio must lie in (0, 1], got {ratio}")
    return {"value": ratio, **ROLLOUT_FILTERS[kind]}


def kept_group_count(num_groups: int, ratio: float, kind: str) -> int | None:
    """Groups the preset ``kind`` keeps when its count is fixed (a top_k preset: int(ratio * num_groups) as RAGEN,
    +1e-9 so 0.29 * 100 keeps 29, not 28; all of them at ratio 1); None when the count depends on the data."""
    preset = ROLLOUT_FILTERS.get(kind)
    if preset is None or preset.get("strategy") != "top_k":
        return None
    value = preset.get("value", ratio)
    return num_groups if value >= 1.0 else int(value * num_groups + 1e-9)


def filter_groups(scores: Tensor, group_ids: Tensor, ratio: float, kind: str,
                  target: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """fastpo's named filters (algorithm.rollout_filter_type) over whole groups, through :func:`select_groups`.

    scores fp32 [B] (trajectory returns), group_ids int [B] (any labels, any order); kind a ROLLOUT_FILTERS name;
    ratio in (0, 1]. Returns keep bool [B] and select_groups' metrics. Unlike RAGEN's top_k clamp, a fixed-count
    preset whose int(ratio * G) is 0 raises (preflight.validate refuses such a ratio). ``target`` (dynamic sampling
    over several rounds): a fixed-count preset keeps exactly ``target`` groups instead of int(ratio * G); a
    data-dependent one keeps at most ``target`` (the lowest group ids among those it selects)."""
    args = legacy_filter_args(kind, ratio)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must both be [B], got {tuple(scores.shape)} and "
                         f"{tuple(group_ids.shape)}")
    g = int(torch.unique(group_ids).numel())
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, int) or target < 1:
            raise ValueError(f"target must be >= 1 groups, got {target!r}")
        if args["strategy"] == "top_k":
            args["value"] = min(1.0, target / g)  # kept_group_count(G, target / G) == target
    count = kept_group_count(g, args["value"], kind)
    if count is not None and count < 1:
        raise ValueError(f"rollout_filter_ratio={ratio} keeps int(ratio * {g} groups) = 0 groups; raise the ratio "
                         f"or the number of groups")
    return select_groups(scores, group_ids, max_groups=target if count is None else None, **args)


# ------------------------------------------------------------------------------- empty stop, loss scaling
@dataclass
class EmptyStop:
    """Counts consecutive training steps whose filter kept nothing; says when to stop training (RAGEN's
    rollout_filter_empty_stop_steps, default 5). A step that keeps any group resets the count. steps: int >= 0,
    0 = never stop. ``count`` is the state to checkpoint."""

    steps: int = 5
    count: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"rollout_filter_empty_stop_steps must be an int >= 0 (0 = off), got {self.steps!r}")

    def update(self, kept_any: bool) -> bool:
        """Record one step; True when training should stop (steps > 0 and count >= steps)."""
        self.count = 0 if kept_any else self.count + 1
        return self.steps > 0 and self.count >= self.steps


LOSS_SCALINGS = ("none", "linear", "sqrt")


def filter_loss_scale(kept_fraction: float, mode: str = "none") -> float:
    """The factor RAGEN's filter_loss_scaling multiplies the advantages (hence the policy-gradient term) by after
    filtering: none -> 1, linear -> kept_fraction, sqrt -> sqrt(kept_fraction); kept_fraction = kept / all groups
    in [0, 1] (``rollout/kept_group_fraction``). Shrinks the update when an aggressive filter keeps few groups."""
    if mode not in LOSS_SCALINGS:
        raise ValueError(f"filter_loss_scaling: unknown {mode!r}; choose from {list(LOSS_SCALINGS)}")
    if not 0.0 <= kept_fraction <= 1.0:
        raise ValueError(f"kept_fraction must lie in [0, 1], got {kept_fraction}")
    return {"none": 1.0, "linear": float(kept_fraction), "sqrt": math.sqrt(kept_fraction)}[mode]


# ------------------------------------------------------------------------------------------- batch adjust
BATCH_ADJUST_MODES = ("none", "copy", "delete")
ADJUST_STREAM = 3
"""The numpy stream id of the batch adjustment's draws: default_rng([trainer.seed, ADJUST_STREAM, step])."""


def adjust_batch(kept: list[int], divisor: int, mode: str, rng: np.random.Generator) -> list[int]:
    """RAGEN-2's batch_adjust_mode: make the kept trajectories a multiple of ``divisor`` (RAGEN: lcm of the env
    groups, the mini-batch size and the GPU count). kept: trajectory indices, in order; divisor int >= 1.
    none: unchanged. copy: append ``divisor - remainder`` indices drawn from kept (without replacement when
    there are enough, else with), so those trajectories count twice in the update. delete: drop ``remainder``
    indices drawn without replacement (all of them when fewer than divisor are kept: the update is skipped).
    Returns the new index list (kept order, copies appended)."""
    if mode not in BATCH_ADJUST_MODES:
        raise ValueError(f"batch_adjust_mode: unknown {mode!r}; choose from {list(BATCH_ADJUST_MODES)}")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")
    n = len(kept)
    remainder = n % divisor
    if mode == "none" or n == 0 or remainder == 0:
        return list(kept)
    if mode == "delete":
        drop = set(rng.choice(n, remainder, replace=False).tolist())
        return [k for j, k in enumerate(kept) if j not in drop]
    extra = divisor - remainder
    return list(kept) + [kept[j] for j in rng.choice(n, extra, replace=extra > n).tolist()]
