"""The numerics of one StarPO update as free functions: data in, data out (the trainer calls them in order).

    order = mini_batches(kept, size=16, shuffle=True, seed=42, step=3, epoch=0)   # [[traj index, ...], ...]
    scales = loss_scales(trajs, order[0], micro, "token-mean", world=2)          # one loss scale per micro-batch
    adv, ret, metrics = advantages(trajs, kept, cfg.algorithm, with_values=True)  # per kept trajectory, [T] each
    logp, ent = token_logp(actor, mb, mask, temperature=1.0, entropy=True)       # fp32 [N], trained positions
    norm, stepped = clip_and_step(actor, optim, sched, loss_sum, grad_clip=1.0)  # skips a non-finite step

Loss scaling: each micro-batch's loss (aggregated over the micro-batch by loss_agg_mode) is multiplied by its share
of the mini-batch (trained tokens for token-mean, trajectories for seq-mean-token-sum / -mean; 1 for
seq-mean-token-sum-norm, a plain token sum over one constant) times the world size (FSDP2 averages gradients over
ranks), so the accumulated gradient equals one loss over the whole mini-batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import algorithms, kernels
from . import distributed as du
from .config import AlgorithmConfig
from .microbatch import MicroBatch, cat_tokens, lm_head_inputs, split_tokens
from .rollout import Trajectory

#: The RNG stream of the mini-batch shuffle: part of its key next to the training seed, apart from the request kinds
#: (0, 1) that key the sampling seeds. Changing it changes every run's mini-batches.
SHUFFLE_STREAM = 2


def mini_batches(kept: list[int], size: int, shuffle: bool, seed: int, step: int, epoch: int = 0) -> list[list[int]]:
    """The mini-batches of one epoch over the kept trajectories. Kept trajectories come group by group, so in order
    a mini-batch would hold whole groups (e.g. 2 of the 8 initial states): each step would chase a few states. With
    ``shuffle`` they are drawn from a permutation seeded by (seed, step, epoch): identical on every rank,
    independent of the world size, reproduced on resume."""
    order = list(kept)
    if shuffle and len(order) > size:
        rng = np.random.default_rng([seed, SHUFFLE_STREAM, step, epoch])
        order = [order[j] for j in rng.permutation(len(order))]
    return [order[i:i + size] for i in range(0, len(order), size)]


def is_on_policy(kept: list[int], mini_batch_size: int, ppo_epochs: int) -> bool:
    """One epoch over one mini-batch: the update's forward runs on the weights that sampled, so its detached logp
    is the old logp (ratio exactly 1) and a separate no-grad scoring pass of the actor is not needed."""
    return ppo_epochs == 1 and len(kept) <= mini_batch_size


def old_logprob_source(kept: list[int], optim: Any, algorithm: AlgorithmConfig, every_row: bool = False) -> str:
    """Where PPO's old logprobs come from this iteration, decided here only:

    - "update": one epoch over one mini-batch (:func:`is_on_policy`): the update's own first forward runs at the
      sampling weights, so its detached logp is the old logp and no scoring pass runs;
    - "sampler": ``algorithm.old_logprobs=engine``: the engine's sample logprobs (:func:`take_engine_logprobs`;
      the trainer scores only the trajectories whose sample logprobs are not exact);
    - "first-update": one epoch over several mini-batches with ``old_logprobs=trainer``: the first mini-batch
      (:func:`first_mini_batch`) takes the detached logp of the update's first forward, which runs at the
      sampling weights, and a scoring pass covers only the others (one mini-batch's forward less per iteration);
    - "trainer": a no-grad scoring pass of the actor at the sampling weights before the update (several epochs
      revisit the first mini-batch after the weights moved; ``every_row``: something before the update needs every
      row's old logprobs, as the gradient analysis does)."""
    if is_on_policy(kept, optim.mini_batch_size, optim.ppo_epochs):
        return "update"
    if algorithm.old_logprobs == "engine":
        return "sampler"
    return "first-update" if optim.ppo_epochs == 1 and not every_row else "trainer"


def first_mini_batch(kept: list[int], optim: Any, seed: int, step: int) -> list[int]:
    """The rows of the update's first mini-batch (epoch 0), as the training loop will draw them."""
    return mini_batches(kept, optim.mini_batch_size, optim.shuffle_mini_batches, seed, step)[0]


def take_engine_logprobs(trajs: list[Trajectory], kept: list[int]) -> tuple[dict[int, np.ndarray], list[int]]:
    """``algorithm.old_logprobs=engine``: the old logprobs of each kept trajectory with exact sample logprobs are
    those (fp32 [T], a copy, 0 off the sampled tokens, as the trainer's scoring leaves them). Returns (index ->
    old logprobs, the kept indices whose sample logprobs are not exact: the trainer must still score them)."""
    old, rest = {}, []
    for i in kept:
        t = trajs[i]
        if t.logprobs_exact:
            old[i] = np.where(t.loss_mask, t.sample_logprobs, 0.0).astype(np.float32)
        else:
            rest.append(i)
    return old, rest


def with_fields(trajs: list[Trajectory], fields: dict[int, dict[str, Any]]) -> list[Trajectory]:
    """New trajectories: ``trajs[j]`` with ``fields[j]`` set (index -> {field: value}); the others as they are.
    Phases of an iteration hand the batch forward this way instead of writing into their input."""
    return [dataclasses.replace(t, **fields[j]) if j in fields else t for j, t in enumerate(trajs)]


def norm_len(trajs: list[Trajectory], kept: list[int]) -> float:
    """seq-mean-token-sum-norm's divisor: the longest kept trajectory, one constant for every micro-batch of the
    iteration (as verl's padded batch width, not each packed micro-batch's own longest sequence, which would weigh
    short micro-batches up)."""
    return float(max(len(trajs[i].input_ids) for i in kept))


def loss_scales(trajs: list[Trajectory], mini_batch: list[int], micro: list[MicroBatch], agg_mode: str,
                world: int) -> list[float]:
    """The loss scale of each of this rank's micro-batches of ``mini_batch`` (see the module docstring)."""
    token_mean = agg_mode == "token-mean"
    total = sum(int(trajs[i].loss_mask.sum()) for i in mini_batch) if token_mean else len(mini_batch)
    scales = []
    for mb in micro:
        part = sum(int(trajs[i].loss_mask.sum()) for i in mb.indices) if token_mean else len(mb.indices)
        scales.append(float(world) if agg_mode == "seq-mean-token-sum-norm" else part / max(total, 1) * world)
    return scales


def turn_samples(trajs: list[Trajectory], kept: list[int]) -> tuple[list[Trajectory], list[int]]:
    """The training sequences of the kept episodes under a per-turn context mode (``rollout.context_window_mode``
    limited_multi_turn / single_turn): each kept episode's ``sample_bounds`` spans become trajectories of their own
    (per-token arrays sliced; ``episode`` = the episode's index in ``trajs``, ``turn`` = k; ``step_keys`` /
    ``step_rewards`` of that turn; the episode's reward, group and counts kept). Returns (the sequences, their
    indices 0..S-1). An episode without ``sample_bounds`` (full mode) passes through as one sequence."""
    out: list[Trajectory] = []
    for i in kept:
        t = trajs[i]
        if t.sample_bounds is None:
            out.append(t)
            continue
        b = t.sample_bounds
        for k in range(len(b) - 1):
            lo, hi = int(b[k]), int(b[k + 1])
            out.append(dataclasses.replace(
                t, input_ids=t.input_ids[lo:hi], loss_mask=t.loss_mask[lo:hi],
                sample_logprobs=t.sample_logprobs[lo:hi], token_rewards=t.token_rewards[lo:hi],
                turn_end=t.turn_end[lo:hi], versions=None if t.versions is None else t.versions[lo:hi],
                step_keys=None if t.step_keys is None else t.step_keys[k:k + 1],
                step_rewards=None if t.step_rewards is None else t.step_rewards[k:k + 1],
                sample_bounds=None, episode=i, turn=k, messages=[]))
    return out, list(range(len(out)))


def _episode_grpo(trajs: list[Trajectory], kept: list[int],
                  cfg: AlgorithmConfig) -> tuple[list[np.ndarray], None, dict[str, float]]:
    """grpo over per-turn sequences (RAGEN-2): the group statistics count each episode once, however many of its
    turns are in the batch (a copy from batch_adjust_mode included), and every sequence of an episode gets that
    episode's advantage on its trained tokens. The estimator runs on one token per episode;
    grpo_length_weight then weighs each sequence by its own trained tokens."""
    first: dict[int, int] = {}
    for i in kept:
        first.setdefault(trajs[i].episode, i)
    eps = list(first.values())
    n = len(eps)
    scores = torch.tensor([trajs[i].reward for i in eps], dtype=torch.float32)
    one = algorithms.PackedBatch(
        token_rewards=scores.clone(), loss_mask=torch.ones(n, dtype=torch.bool),
        turn_end=torch.ones(n, dtype=torch.bool), cu_seqlens=torch.arange(n + 1, dtype=torch.int64), scores=scores,
        group_ids=torch.tensor([trajs[i].group for i in eps], dtype=torch.int64))
    per_ep, _ = algorithms.compute_advantages(one, dataclasses.replace(cfg, grpo_length_weight=False))
    value = dict(zip(first, per_ep.tolist(), strict=True))
    adv = [np.where(trajs[i].loss_mask, np.float32(value[trajs[i].episode]), np.float32(0)).astype(np.float32)
           for i in kept]
    if cfg.grpo_length_weight:
        cu = torch.tensor([0, *np.cumsum([len(trajs[i].input_ids) for i in kept])], dtype=torch.int64)
        weight = algorithms.length_weight(cat_tokens(trajs, kept, "loss_mask", torch.device("cpu")), cu)
        adv = [a * np.float32(w) for a, w in zip(adv, weight.tolist(), strict=True)]
    return adv, None, one.metrics


def advantages(trajs: list[Trajectory], kept: list[int], cfg: AlgorithmConfig,
               with_values: bool) -> tuple[list[np.ndarray], list[np.ndarray] | None, dict[str, float]]:
    """``algorithms.compute_advantages`` over the kept trajectories packed into one batch (on the CPU, identical on
    every rank): (advantages fp32 [T] per kept trajectory, returns likewise or None, the estimator's metrics).
    ``with_values`` reads ``Trajectory.values`` (a critic scored them); per-turn data (``step_keys`` /
    ``step_rewards``) is passed when every kept trajectory has it (GiGPO reads it). Per-turn sequences
    (:func:`turn_samples`): grpo counts each episode once (:func:`_episode_grpo`); the other estimators treat
    each sequence as a trajectory whose return is the episode's (RAGEN-2)."""
    if cfg.adv_estimator == "grpo" and kept and any(trajs[i].episode >= 0 for i in kept):
        return _episode_grpo(trajs, kept, cfg)
    cpu = torch.device("cpu")
    cu = torch.tensor([0, *np.cumsum([len(trajs[i].input_ids) for i in kept])], dtype=torch.int64)
    batch = algorithms.PackedBatch(
        token_rewards=cat_tokens(trajs, kept, "token_rewards", cpu),
        loss_mask=cat_tokens(trajs, kept, "loss_mask", cpu), turn_end=cat_tokens(trajs, kept, "turn_end", cpu),
        cu_seqlens=cu, scores=torch.tensor([trajs[i].reward for i in kept], dtype=torch.float32),
        group_ids=torch.tensor([trajs[i].group for i in kept], dtype=torch.int64),
        values=cat_tokens(trajs, kept, "values", cpu) if with_values else None)
    if all(trajs[i].step_keys is not None for i in kept):
        batch.cu_turns = torch.tensor([0, *np.cumsum([len(trajs[i].step_keys) for i in kept])], dtype=torch.int64)
        batch.turn_keys = cat_tokens(trajs, kept, "step_keys", cpu)
        batch.turn_rewards = cat_tokens(trajs, kept, "step_rewards", cpu)
        batch.turn_ids = algorithms.token_turn_ids(batch.turn_end, cu, batch.cu_turns)
    adv, ret = algorithms.compute_advantages(batch, cfg)
    return split_tokens(adv, cu), (split_tokens(ret, cu) if ret is not None else None), batch.metrics


def _fresh(t: Trajectory, version: int | None, whole_context: bool = False) -> np.ndarray:
    """bool [T]: the tokens the parity guard compares: exact sample logprobs, sampled at weight ``version`` (under
    partial rollouts older tokens differ by the policy's own change, not by a broken sync; None: every token).
    whole_context (rollout.partial_kv keep): only in episodes whose first sampled token is of ``version`` too; a
    later turn of an older episode attended to keys / values older weights computed, so it differs by the update."""
    if not t.logprobs_exact:
        return np.zeros(len(t.input_ids), dtype=bool)
    if version is None or t.versions is None:
        return np.ones(len(t.input_ids), dtype=bool)
    sampled = t.versions[t.versions >= 0]
    if whole_context and sampled.size and int(sampled.min()) != version:
        return np.zeros(len(t.input_ids), dtype=bool)
    return t.versions == version


def gap_sums(trajs: list[Trajectory], kept: list[int], train_on_observations: bool, version: int | None = None,
             whole_context: bool = False) -> tuple[float, int, float]:
    """(sum, count, max) of |engine logp - trainer logp| over the tokens :func:`logprob_gap` compares."""
    if train_on_observations:
        return 0.0, 0, 0.0
    gaps = [np.abs(trajs[i].sample_logprobs - trajs[i].old_logp)[trajs[i].loss_mask
                                                                   & _fresh(trajs[i], version, whole_context)]
            for i in kept]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    return float(gaps.sum(dtype=np.float64)), int(gaps.size), float(gaps.max()) if gaps.size else 0.0


def logprob_gap(trajs: list[Trajectory], kept: list[int], train_on_observations: bool,
                version: int | None = None, whole_context: bool = False) -> dict[str, float]:
    """Mean and max |engine logp - trainer logp| over the trained tokens of the kept trajectories whose sample
    logprobs are exact and (``version`` given) were sampled at that weight version ({} when no token qualifies;
    observation tokens have no sample logprob). whole_context: see ``_fresh`` (rollout.partial_kv keep)."""
    total, count, peak = gap_sums(trajs, kept, train_on_observations, version, whole_context)
    if not count:
        return {}
    return {"rollout/logprob_gap_mean": total / count, "rollout/logprob_gap_max": peak}


def micro_gap(trajs: list[Trajectory], mb: MicroBatch, mask: Tensor, logp: Tensor,
              version: int | None = None, whole_context: bool = False) -> tuple[float, int, float]:
    """(sum, count, max) of |engine logp - trainer logp| over one micro-batch's trained tokens that
    :func:`logprob_gap` compares: its on-policy form, from the update's own forward."""
    fresh = torch.from_numpy(np.concatenate([_fresh(trajs[i], version, whole_context)
                                             for i in mb.indices])).to(mask.device)
    diff = (cat_tokens(trajs, mb.indices, "sample_logprobs", mask.device) - logp)[mask.bool() & fresh].abs()
    return float(diff.sum()), int(diff.numel()), float(diff.max()) if diff.numel() else 0.0


def staleness(trajs: list[Trajectory], kept: list[int], version: int) -> dict[str, float]:
    """How many weight versions the kept trajectories' trained tokens lag ``version`` (the weights being trained):
    ``rollout/staleness_mean`` / ``_max`` and ``rollout/stale_token_share`` (lag > 0). {} when no trajectory
    records versions."""
    lags = [version - trajs[i].versions[trajs[i].loss_mask & (trajs[i].versions >= 0)]
            for i in kept if trajs[i].versions is not None]
    lags = np.concatenate(lags) if lags else np.zeros(0)
    if not lags.size:
        return {}
    return {"rollout/staleness_mean": float(lags.mean()), "rollout/staleness_max": float(lags.max()),
            "rollout/stale_token_share": float((lags > 0).mean())}


def reduce_gap(total: float, count: int, peak: float,
               prior: tuple[float, int, float] = (0.0, 0, 0.0)) -> dict[str, float]:
    """The ranks' :func:`micro_gap` sums combined into :func:`logprob_gap`'s metrics ({} when no token
    qualified); collective. ``prior``: :func:`gap_sums` of the rows a scoring pass measured (the same on every
    rank, so added after the reduction)."""
    total, count = du.all_reduce_sum([total, float(count)])
    peak = du.all_reduce_max(peak)
    total, count, peak = total + prior[0], count + prior[1], max(peak, prior[2])
    if count == 0:
        return {}
    return {"rollout/logprob_gap_mean": float(total / count), "rollout/logprob_gap_max": float(peak)}


def token_logp(model: nn.Module, mb: MicroBatch, mask: Tensor, temperature: float, entropy: bool):
    """logp (and entropy) fp32 [N] of every token of a micro-batch under ``model`` at the sampling temperature,
    from the last hidden states and the lm-head weight (``fastpo.kernels.fused_linear_logprob``, no logits);
    computed on the trained positions only (0 where ``mask`` is 0)."""
    hidden, weight, bias = lm_head_inputs(model, mb)
    tgt = mask.nonzero().squeeze(-1)
    out = kernels.fused_linear_logprob(hidden[0, tgt - 1], weight, mb.input_ids[0, tgt], bias,
                                       temperature=temperature, return_entropy=entropy)
    vals = out if isinstance(out, tuple) else (out,)
    full = tuple(torch.zeros(mask.shape[0], dtype=torch.float32, device=mask.device).index_copy(0, tgt, v)
                 for v in vals)
    return full if entropy else full[0]


def token_values(critic: nn.Module, mb: MicroBatch, mask: Tensor) -> Tensor:
    """Critic values fp32 [N]: V_t from the hidden state before token t (verl's alignment), 0 off the mask."""
    v = mb.to_packed(critic(**mb.model_inputs(critic)))[0]
    tgt = mask.nonzero().squeeze(-1)
    return torch.zeros_like(v, dtype=torch.float32).index_copy(0, tgt, v[tgt - 1].float())


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2 gradient accumulation (``optim.defer_grad_sync``): with ``sync`` False the next backward keeps its
    gradients unsharded (accumulated in the reduce dtype, fp32) and the weights gathered; the next backward with
    ``sync`` True reduce-scatters the accumulated sum once. No-op for a model that is not FSDP-sharded."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
        model.set_reshard_after_backward(sync)


def clip_and_step(model: nn.Module, optim: torch.optim.Optimizer, sched: Any, loss_sum: float,
                  grad_clip: float) -> tuple[float, bool]:
    """Clip the gradient norm, then step (optimiser and schedule) unless the loss or the norm is non-finite on any
    rank (collective: the same decision everywhere); gradients are cleared either way. Returns (norm, stepped)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    ok = math.isfinite(norm) and math.isfinite(loss_sum)
    ok = du.all_reduce_max(0.0 if ok else 1.0) == 0.0
    if ok:
        optim.step()
        sched.step()
    optim.zero_grad(set_to_none=True)
    return norm, ok


def metric_means(sums: dict[str, float], world: int, steps: int) -> dict[str, float]:
    """Share-weighted per-rank metric sums (each rank's micro-batch values times its loss scale / world) ->
    mini-batch means averaged over the ``steps`` optimiser steps; collective."""
    parts = du.all_gather_list([sums])
    keys = sorted({k for p in parts for k in p})
    means = {k: float(np.mean([p[k] for p in parts if k in p])) for k in keys}
    return {k: v * world / steps for k, v in means.items()}
