"""RAGEN-2's diagnostics: the collapse metrics (do the policy's thoughts still depend on its input?), the group
reward-variance table (:func:`group_rv_rows`) and the reward-variance buckets of the gradient analysis
(:func:`rv_buckets`; the gradients themselves: ``Trainer._gradient_analysis``).

Entropy collapse makes the thought z nearly fixed for each input x (low H(Z|X)). Template collapse makes it the
same for every input (low I(X;Z)): the policy reasons from a template, whatever the state. RAGEN-2 measures the
second with a mutual-information proxy over the batch: score every sampled thought under every sampled prompt with
the current actor, and compare its log-probability under its own prompt with the log of the mean probability under
all prompts (the batch's prompts as a uniform mixture, not the true input distribution).

Two samples of (prompt, thought) pairs, as RAGEN-2 draws them:
    first turn   the first prompt of each trajectory and its first thought; trajectories of a group share the
                 prompt, so the columns are the groups (the prompt of a group is the same initial state).
    multi turn   trajectory-uniform: a trajectory uniformly, then one of its turns uniformly, `num_samples`
                 times (with replacement); each draw is its own column (its own context).

A thought is the text between the response's first ``<think>`` and the next ``</think>``, with the special strings
deleted and stripped, re-tokenized without special tokens (RAGEN's ctx_manager); a turn without one is not a
valid sample. A prompt is the chat up to that turn rendered for generation, ending with ``<think>``.

    from fastpo import diagnostics
    if diagnostics.collapse_due(cfg.trainer, step):
        metrics.update(detector(trajs, tokenizer, score, step))   # detector = diagnostics.CollapseDetector(cfg)

The metrics are fastpo's keys ``collapse/first_turn/*`` and ``collapse/multi_turn/*``; under
``trainer.metric_names ragen`` they become RAGEN's ``collapse_first_turn_sample/*`` and
``collapse_trajectory_sample/*`` (``fastpo.metrics.RAGEN_PREFIXES``). docs/LOGGING.md defines each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .parsing import SPECIAL_STRINGS, THINK_CLOSE, THINK_OPEN
from .prompts import render_chat

#: (prompt ids, thought ids) of one assistant turn.
Pair = tuple[list[int], list[int]]

#: Added to a standard deviation before dividing by it (RAGEN's std_eps).
STD_EPS = 1e-3
#: Weight of the old value in the running mean of the marginal's std (RAGEN's ema_decay).
EMA_DECAY = 0.9
#: The k of the top-k retrieval accuracies (k is capped at the number of prompts).
RETRIEVAL_KS = (2, 4, 8)

#: score([(input_ids int64 [T], loss_mask bool [T], group), ...]) -> the actor's summed logprob of each sequence's
#: masked tokens, in order; collective (every rank passes the same sequences; ``Trainer._sequence_logps``).
ScoreFn = Callable[[list[tuple[np.ndarray, np.ndarray, int]]], list[float]]


def collapse_due(trainer_cfg: Any, step: int) -> bool:
    """Whether iteration `step` (1-based) computes the collapse metrics: off when ``trainer.collapse_every`` is 0;
    else at iteration 1 and at every multiple of it (RAGEN's compute_freq)."""
    every = trainer_cfg.collapse_every
    return every > 0 and step >= 1 and (step == 1 or step % every == 0)


def think_text(response: str) -> str:
    """The thought of an assistant response: the text between its first ``<think>`` and the next ``</think>``
    (``""`` without both), the special strings deleted one after the other, stripped. Linear time (a search for
    the pair that a lazy regex would make quadratic on text with many ``<think>``)."""
    start = response.find(THINK_OPEN)
    if start < 0:
        return ""
    end = response.find(THINK_CLOSE, start + len(THINK_OPEN))
    if end < 0:
        return ""
    text = response[start + len(THINK_OPEN):end]
    for special in SPECIAL_STRINGS:
        text = text.replace(special, "")
    return text.strip()


def turn_pairs(traj: Any, tokenizer: Any, enable_think: bool = True) -> list[Pair]:
    """(prompt ids, thought ids) of every assistant turn of `traj` (a ``fastpo.rollout.Trajectory``: its chat
    ``messages``), oldest first; a turn without a thought has empty thought ids."""
    out = []
    for m, message in enumerate(traj.messages):
        if message["role"] != "assistant":
            continue
        prompt = render_chat(tokenizer, traj.messages[:m], enable_think)
        thought = think_text(message["content"])
        out.append((list(tokenizer.encode(prompt, add_special_tokens=False)),
                    list(tokenizer.encode(thought, add_special_tokens=False)) if thought else []))
    return out


def log_prob_stats(cross: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matched [S] = cross[i, cols[i]] (log p(z_i | x_i)) and marginal [S] = log(mean_j exp(cross[i, j]))
    (log p(z_i) under the uniform mixture of the N prompts), from cross fp [S, N] = log p(z_i | x_j)."""
    matched = cross[torch.arange(cross.shape[0]), cols]
    return matched, torch.logsumexp(cross, dim=1) - math.log(cross.shape[1])


def retrieval_metrics(cross: torch.Tensor, cols: torch.Tensor, signatures: Sequence[Any]) -> dict[str, float]:
    """How often a thought's best-scoring prompt is its own: accuracy (argmax; the first on ties), top-k accuracies
    for k in :data:`RETRIEVAL_KS` (k capped at N), their chance levels and the margins above chance. Columns with
    equal `signatures` (the same prompt) count as the same answer; the chance level of a thought is the share of
    columns with its prompt (times k for top-k, at most 1), averaged over thoughts."""
    n = cross.shape[1]
    ids = {s: i for i, s in enumerate(dict.fromkeys(signatures))}
    sig_of_col = torch.tensor([ids[s] for s in signatures])
    true_sig = sig_of_col[cols]
    accuracy = float((sig_of_col[cross.argmax(dim=1)] == true_sig).float().mean())
    share = torch.bincount(sig_of_col, minlength=int(sig_of_col.max()) + 1).double() / n
    chance = float(share[true_sig].mean())
    out = {"retrieval_accuracy": accuracy, "retrieval_chance_level": chance,
           "retrieval_above_chance": accuracy - chance}
    top = torch.topk(cross, min(max(RETRIEVAL_KS), n), dim=1).indices
    for k in RETRIEVAL_KS:
        k_eff = min(k, n)
        hit = float((sig_of_col[top[:, :k_eff]] == true_sig[:, None]).any(dim=1).float().mean())
        out[f"retrieval_accuracy@{k}"] = hit
        out[f"retrieval_chance_level@{k}"] = min(1.0, chance * k_eff)
        out[f"retrieval_above_chance@{k}"] = hit - min(1.0, chance * k_eff)
    return out


def pair_metrics(cross_mean: torch.Tensor, cross_sum: torch.Tensor, cols: torch.Tensor,
                 signatures: Sequence[Any]) -> dict[str, float]:
    """The MI proxy and its companions for one sample of pairs.

    Args:
        cross_mean: fp64 [S, N] log p(z_i | x_j) per token of z_i (the sum over its tokens / their count).
        cross_sum: fp64 [S, N] the same summed over the tokens (the ``*_seq`` metrics).
        cols: int64 [S] the column of each thought's own prompt.
        signatures: N hashables, equal for columns holding the same prompt.

    Returns:
        mi_estimate = mean(matched) - mean(marginal) (per token), mi_upper_bound = log N, the two means,
        mi_seq_estimate (per sequence), conditional_entropy_est = -mean(matched), reasoning_entropy_est =
        -mean(marginal) and their ``_seq_est`` twins, marginal_std(_seq) (population std over the thoughts),
        mi_zscore(_seq) = mean((matched - marginal) / (marginal_std + STD_EPS)), and :func:`retrieval_metrics`.
    """
    matched, marginal = log_prob_stats(cross_mean, cols)
    matched_sum, marginal_sum = log_prob_stats(cross_sum, cols)
    std, std_seq = float(marginal.std(unbiased=False)), float(marginal_sum.std(unbiased=False))
    out = {
        "mi_estimate": float(matched.mean() - marginal.mean()),
        "mi_upper_bound": math.log(cross_mean.shape[1]),
        "matched_log_prob_mean": float(matched.mean()),
        "marginal_log_prob_mean": float(marginal.mean()),
        "mi_seq_estimate": float((matched_sum - marginal_sum).mean()),
        "conditional_entropy_est": -float(matched.mean()),
        "reasoning_entropy_est": -float(marginal.mean()),
        "conditional_entropy_seq_est": -float(matched_sum.mean()),
        "reasoning_entropy_seq_est": -float(marginal_sum.mean()),
        "marginal_std": std,
        "marginal_std_seq": std_seq,
        "mi_zscore": float(((matched - marginal) / (std + STD_EPS)).mean()),
        "mi_zscore_seq": float(((matched_sum - marginal_sum) / (std_seq + STD_EPS)).mean()),
    }
    out.update(retrieval_metrics(cross_mean, cols, signatures))
    return out


def first_turn_sample(pairs: Sequence[Sequence[Pair]], groups: Sequence[int], num_samples: int,
                      rng: np.random.Generator) -> tuple[list[Pair], list[int]]:
    """The first-turn pairs of the trajectories whose first turn has a thought, `num_samples` of them drawn without
    replacement when there are more (0 = all), in trajectory order; returns (pairs, the group of each)."""
    valid = [i for i, p in enumerate(pairs) if p and p[0][1]]
    if 0 < num_samples < len(valid):
        valid = sorted(rng.choice(valid, num_samples, replace=False).tolist())
    return [pairs[i][0] for i in valid], [int(groups[i]) for i in valid]


def trajectory_uniform_sample(pairs: Sequence[Sequence[Pair]], num_samples: int,
                              rng: np.random.Generator) -> list[Pair]:
    """Trajectory-uniform draws over the turns that have a thought: min(num_samples, their count) times (0 = their
    count), a trajectory uniformly, then one of its valid turns uniformly; a draw that lands on a trajectory without
    one yields nothing (RAGEN's rule: P(m, t) = 1/M x 1/T_m)."""
    valid = [[p for p in traj if p[1]] for traj in pairs]
    total = sum(len(v) for v in valid)
    draws = total if num_samples == 0 else min(num_samples, total)
    out = []
    for _ in range(draws):
        m = int(rng.integers(len(valid)))
        if valid[m]:
            out.append(valid[m][int(rng.integers(len(valid[m])))])
    return out


def cross_scores(pairs: Sequence[Pair], prompts: Sequence[list[int]],
                 score: ScoreFn) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross_mean, cross_sum) fp64 [S, N]: every thought of `pairs` scored after every prompt of `prompts` by the
    actor (one collective call of `score` over the S x N sequences, prompt j's sequences sharing group j, so the
    shared micro-batch layout runs each prompt once per micro-batch)."""
    seqs = [(np.asarray(x + z, dtype=np.int64), np.asarray([False] * len(x) + [True] * len(z)), j)
            for _, z in pairs for j, x in enumerate(prompts)]
    logps = score(seqs)
    n = len(prompts)
    total = torch.tensor(logps, dtype=torch.float64).reshape(len(pairs), n)
    counts = torch.tensor([max(len(z), 1) for _, z in pairs], dtype=torch.float64)[:, None]
    return total / counts, total


def group_rv_rows(rewards: Sequence[float], groups: Sequence[int], keep: Sequence[bool]) -> list[dict[str, Any]]:
    """RAGEN's group reward-variance table of one iteration: per group (in order of first appearance) its id, the
    sample std (ddof 1; 0 for a group of one) of its trajectories' scores, and whether the filter kept it.

    Args:
        rewards: fp [B] each trajectory's score (``Trajectory.reward``, what the filter ranks).
        groups: int [B] each trajectory's group id.
        keep: bool [B] the filter's decision per trajectory (a group is kept whole).
    """
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    rows = []
    for g, idx in members.items():
        scores = np.asarray([rewards[i] for i in idx], dtype=np.float64)
        std = float(scores.std(ddof=1)) if len(idx) > 1 else 0.0
        rows.append({"group_id": g, "reward_std": std, "selected": bool(any(keep[i] for i in idx))})
    return rows


#: RAGEN's gradient-analysis bucket modes: quantile (equal numbers of groups by reward std) or fixed_rv.
BUCKET_MODES = ("quantile", "fixed_rv")
#: fixed_rv's lower edges: reward std in [0, 1), [1, 2), ..., [5, inf).
FIXED_RV_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)


def gradient_analysis_due(trainer_cfg: Any, step: int) -> bool:
    """Whether iteration `step` (1-based) runs the gradient analysis: off when ``trainer.gradient_analysis_every``
    is 0; else at iterations 1, N + 1, 2N + 1, ... (RAGEN's (step - 1) % every == 0)."""
    every = trainer_cfg.gradient_analysis_every
    return every > 0 and step >= 1 and (step - 1) % every == 0


def rv_buckets(group_std: Sequence[float], num_buckets: int, mode: str) -> dict[str, list[int]]:
    """RAGEN-2's reward-variance buckets of the groups (positions into `group_std`): "all", then "bucket_1", ...

    quantile: the groups sorted by reward std (ties in the given order), min(num_buckets, G) buckets of G // that
    many groups each, the remainder going to the last one. fixed_rv: bucket_k holds the stds in
    [FIXED_RV_EDGES[k-1], FIXED_RV_EDGES[k]) (the last one up to inf); they may be empty."""
    if mode not in BUCKET_MODES:
        raise ValueError(f"bucket mode must be one of {BUCKET_MODES}, got {mode!r}")
    out = {"all": list(range(len(group_std)))}
    if mode == "fixed_rv":
        for k, low in enumerate(FIXED_RV_EDGES):
            high = FIXED_RV_EDGES[k + 1] if k + 1 < len(FIXED_RV_EDGES) else math.inf
            out[f"bucket_{k + 1}"] = [g for g, s in enumerate(group_std) if low <= s < high]
        return out
    n = min(num_buckets, len(group_std))
    order = sorted(range(len(group_std)), key=lambda g: group_std[g])
    start = 0
    for k in range(n):
        size = len(group_std) // n + (len(group_std) % n if k == n - 1 else 0)
        out[f"bucket_{k + 1}"] = order[start:start + size]
        start += size
    return out


class CollapseDetector:
    """RAGEN-2's collapse metrics for a run: the settings and the running mean of the marginal's std per sample
    kind (kept in memory only: it changes what is logged, never the training)."""

    def __init__(self, cfg: Any):
        t = cfg.trainer
        self.first_turn, self.multi_turn = t.collapse_first_turn, t.collapse_multi_turn
        self.num_samples, self.seed = t.collapse_num_samples, t.seed
        self.enable_think = cfg.rollout.enable_think
        self.ema: dict[str, float] = {}

    def _ema(self, key: str, value: float) -> float:
        self.ema[key] = value if key not in self.ema else EMA_DECAY * self.ema[key] + (1 - EMA_DECAY) * value
        return self.ema[key]

    def _sample_metrics(self, kind: str, pairs: list[Pair], cols: list[int],
                        prompts: list[list[int]], score: ScoreFn) -> dict[str, float]:
        if len(prompts) < 2:  # one prompt: nothing to tell thoughts apart by
            return {}
        cross_mean, cross_sum = cross_scores(pairs, prompts, score)
        m = pair_metrics(cross_mean, cross_sum, torch.tensor(cols), [tuple(p) for p in prompts])
        matched, marginal = log_prob_stats(cross_mean, torch.tensor(cols))
        matched_sum, marginal_sum = log_prob_stats(cross_sum, torch.tensor(cols))
        m["marginal_std_ema"] = ema = self._ema(kind, m["marginal_std"])
        m["marginal_std_ema_seq"] = ema_seq = self._ema(kind + "_seq", m["marginal_std_seq"])
        m["mi_zscore_ema"] = float(((matched - marginal) / (ema + STD_EPS)).mean())
        m["mi_zscore_ema_seq"] = float(((matched_sum - marginal_sum) / (ema_seq + STD_EPS)).mean())
        return {f"collapse/{kind}/{k}": v for k, v in m.items()}

    def __call__(self, trajs: Sequence[Any], tokenizer: Any, score: ScoreFn, step: int) -> dict[str, float]:
        """The metrics of one iteration's trajectories (every rank holds all of them; collective through `score`).
        The draws come from a generator seeded by (trainer.seed, step): the same on every rank, and the global
        RNGs the training draws from are not touched."""
        rng = np.random.default_rng([self.seed, step])
        pairs = [turn_pairs(t, tokenizer, self.enable_think) for t in trajs]
        out: dict[str, float] = {}
        if self.multi_turn:
            start = time.perf_counter()
            valid = sum(1 for traj in pairs for p in traj if p[1])
            total = sum(len(traj) for traj in pairs)
            out["collapse/valid_thinking_rate"] = valid / total if total else 0.0
            sample = trajectory_uniform_sample(pairs, self.num_samples, rng)
            out.update(self._sample_metrics("multi_turn", sample, list(range(len(sample))),
                                            [x for x, _ in sample], score))
            out["timing/collapse_multi_turn"] = time.perf_counter() - start
        if self.first_turn:
            start = time.perf_counter()
            valid = sum(1 for traj in pairs if traj and traj[0][1])
            out["collapse/first_turn_num_total"] = float(len(trajs))
            out["collapse/first_turn_num_valid"] = float(valid)
            out["collapse/first_turn_valid_rate"] = valid / len(trajs) if trajs else 0.0
            sample, groups = first_turn_sample(pairs, [t.group for t in trajs], self.num_samples, rng)
            columns = sorted(set(groups))
            prompts = [next(x for (x, _), g in zip(sample, groups, strict=True) if g == gid) for gid in columns]
            cols = [columns.index(g) for g in groups]
            out.update(self._sample_metrics("first_turn", sample, cols, prompts, score))
            out["timing/collapse_first_turn"] = time.perf_counter() - start
        return out
