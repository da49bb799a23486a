"""Rollout metrics: per-batch means over trajectories (``rollout/...``, ``<prefix>/<Env>/...``) and their sums to
combine across env parts and ranks (docs/SEMANTICS.md sections 7-8)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def batch_metrics(eps: Sequence[Any], trajs: Sequence[Any], timings: dict[str, float], label: str,
                  prefix: str) -> dict[str, float]:
    """Batch metrics (docs/SEMANTICS.md sections 7-8). ``action_is_valid`` / ``action_is_effective`` follow RAGEN's
    ``get_rollout_states``: per trajectory, the flags of each turn's LAST executed action summed over turns and
    divided by the number of turns (a turn without an executed action counts 0), then averaged over
    trajectories. ``in_group_std``: unbiased std of ``Trajectory.reward`` per group (0 for a group of one),
    averaged over groups. ``pass@G``: fraction of groups with at least one success (G = the largest group)."""
    by_group: dict[int, list[Any]] = defaultdict(list)
    for t in trajs:
        by_group[t.group].append(t)
    group_size = max((len(v) for v in by_group.values()), default=0)
    stds = [float(np.std([t.reward for t in v], ddof=1)) if len(v) > 1 else 0.0 for v in by_group.values()]
    pass_at = _mean([float(any(t.success for t in v)) for v in by_group.values()])
    valid = [sum(e.last_valid) / len(e.last_valid) if e.last_valid else 0.0 for e in eps]
    effective = [sum(e.last_effective) / len(e.last_effective) if e.last_effective else 0.0 for e in eps]
    lengths = [n for t in trajs for n in t.response_lengths]
    turns_total = max(1, sum(t.num_turns for t in trajs))
    actions_total = max(1, sum(t.num_actions for t in trajs))
    per_env = {
        "success": _mean([float(t.success) for t in trajs]),
        "action_is_valid": _mean(valid),
        "action_is_effective": _mean(effective),
        "num_actions": _mean([t.num_actions for t in trajs]),
        f"pass@{group_size}": pass_at,
    }
    metrics = {f"rollout/{k}": v for k, v in per_env.items()}
    metrics.update({f"{prefix}/{label}/{k}": v for k, v in per_env.items()})
    metrics.update(
        {
            "rollout/reward": _mean([t.reward for t in trajs]),
            "rollout/reward_std": float(np.std([t.reward for t in trajs])) if trajs else 0.0,
            "rollout/in_group_std": _mean(stds),
            "rollout/num_turns": _mean([t.num_turns for t in trajs]),
            "rollout/valid_action_rate": sum(t.num_valid_actions for t in trajs) / actions_total,
            "rollout/effective_action_rate": sum(t.num_effective_actions for t in trajs) / actions_total,
            "rollout/format_penalty_rate": sum(t.num_format_penalties for t in trajs) / turns_total,
            "rollout/response_length": _mean(lengths),
            "rollout/response_length_max": float(max(lengths, default=0)),
            "rollout/length_stop_rate": sum(r == "length" for t in trajs for r in t.finish_reasons) / turns_total,
            "rollout/context_truncated": _mean([float(t.context_truncated) for t in trajs]),
            "rollout/seq_len": _mean([len(t.input_ids) for t in trajs]),
            "rollout/seq_len_max": float(max((len(t.input_ids) for t in trajs), default=0)),
            "rollout/trained_tokens": float(sum(sum(t.loss_mask) for t in trajs)),
        }
    )
    metrics.update({f"rollout/{k}": v for k, v in timings.items()})
    metrics.update({f"{prefix}/{label}/{k}": v for k, v in timings.items() if k != "prompt_s"})
    assert all(math.isfinite(v) for v in metrics.values())
    return metrics


def metric_sums(batches: Sequence[Any]) -> tuple[dict[str, float], dict[str, int]]:
    """Several batches' metrics as (sums, counts) to combine across parts and ranks: each mean weighted by its
    batch's trajectory count (parts share the ``rollout/...`` keys; ranks of an env mix hold different numbers of
    trajectories), each ``..._max`` key by max (count 1)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for batch in batches:
        n = len(batch.trajectories)
        for key, value in batch.metrics.items():
            _add(sums, counts, key, value * (1 if key.endswith("_max") else n), 1 if key.endswith("_max") else n)
    return sums, counts


def combine_metric_sums(parts: Sequence[tuple[dict[str, float], dict[str, int]]]) -> dict[str, float]:
    """The (sums, counts) of :func:`metric_sums` from several ranks -> one metric dict (means, and maxima)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part_sums, part_counts in parts:
        for key, value in part_sums.items():
            _add(sums, counts, key, value, part_counts[key])
    return {key: sums[key] / max(counts[key], 1) for key in sorted(sums)}


def _add(sums: dict[str, float], counts: dict[str, int], key: str, value: float, count: int) -> None:
    if key.endswith("_max"):
        sums[key], counts[key] = max(sums.get(key, -math.inf), value), 1
    else:
        sums[key], counts[key] = sums.get(key, 0.0) + value, counts.get(key, 0) + count
