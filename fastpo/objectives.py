"""The two losses the trainer's one training loop (``Trainer._fit``) takes as an argument: the critic's value loss
and the actor's clipped policy loss, each for one micro-batch.

    objective = ActorObjective(actor, trajs, cfg, device, norm_len=412.0, source="trainer", version=3, ...)
    loss, metrics = objective(mb, mask, step)     # fp32 scalar, {name: value}; step = optimiser step of the update
    objective.before_step(step)                   # after a step's micro-batches, before the weights move
    objective.finish()                            # the update's own metrics (collective)

An objective holds only what one update needs (the models, the trajectories, the settings); the loop owns the
optimiser, the mini-batches, the loss scales and the non-finite accounting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import algorithms, kernels, update
from . import distributed as du
from .microbatch import MicroBatch, cat_tokens
from .rollout import Trajectory

#: Where PPO's old logprobs come from in one iteration (``update.old_logprob_source``).
OLD_LOGPROB_SOURCES = ("update", "sampler", "first-update", "trainer")


class CriticObjective:
    """The value loss (``algorithms.critic_loss``) of a micro-batch: V from the critic against the scored values and
    the returns."""

    name = "critic"

    def __init__(self, critic: nn.Module, trajs: list[Trajectory], cfg: Any, device: torch.device, norm_len: float):
        self.critic, self.trajs, self.cfg, self.device, self.norm_len = critic, trajs, cfg, device, norm_len

    def __call__(self, mb: MicroBatch, mask: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        t, dev = self.trajs, self.device
        return algorithms.critic_loss(update.token_values(self.critic, mb, mask), cat_tokens(t, mb.indices, "values",
                                                                                             dev),
                                      cat_tokens(t, mb.indices, "returns", dev), mask, self.cfg.algorithm,
                                      cu_seqlens=mb.cu_seqlens, norm_len=self.norm_len)

    def before_step(self, step: int) -> None:
        return None

    def finish(self) -> dict[str, float]:
        return {}


class ActorObjective:
    """The clipped policy loss (``algorithms.policy_loss``) of a micro-batch.

    Args:
        source: where the old logprobs come from (``update.old_logprob_source``). "update": the detached logp of
            this forward (one optimiser step on the sampling weights); "first-update": that in the first optimiser
            step (its mini-batch was not scored), ``Trajectory.old_logp`` after it; otherwise ``Trajectory.old_logp``.
        version: the engine's weight version now (the parity guard compares only tokens sampled at it; under
            rollout.partial_kv keep only in episodes sampled wholly at it, ``update._fresh``).
        ref_logp: ``fn(mb, mask) -> fp32 [N]`` the reference logprobs, or None (no KL term).
        check_gap: the parity guard, called with the measured gap before the first optimiser step when no scoring
            pass measured it ("update" and "sampler") or measured only part of it ("first-update").
        inject_nan: the ``FASTPO_INJECT_NAN_AT`` test hook for this iteration.
        prior_gap: ``update.gap_sums`` of the rows the scoring pass measured ("first-update": the guard then judges
            them together with the first step's rows).
    """

    name = "actor"

    def __init__(self, actor: nn.Module, trajs: list[Trajectory], cfg: Any, device: torch.device, norm_len: float,
                 source: str, version: int, ref_logp: Callable[[MicroBatch, Tensor], Tensor] | None,
                 check_gap: Callable[[dict[str, float]], None], inject_nan: bool = False,
                 prior_gap: tuple[float, int, float] = (0.0, 0, 0.0)):
        if source not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"source must be one of {OLD_LOGPROB_SOURCES}, got {source!r}")
        self.actor, self.trajs, self.cfg, self.device, self.norm_len = actor, trajs, cfg, device, norm_len
        self.source, self.version, self.ref_logp, self.check_gap = source, version, ref_logp, check_gap
        self.inject, self.prior_gap = inject_nan, prior_gap
        # the first optimiser step's forward runs at the sampling weights: measure the engine-trainer gap there when
        # no scoring pass did
        self.measure = source != "trainer" and not cfg.rollout.train_on_observations
        self.correct = cfg.algorithm.offpolicy_correction != "none"
        self.gap, self.measured = [0.0, 0, 0.0], {}
        self.is_range = [-float("inf"), float("inf")]  # the update's largest / smallest ratio (true extremes)

    def __call__(self, mb: MicroBatch, mask: Tensor, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        t, dev, a = self.trajs, self.device, self.cfg.algorithm
        logp, ent = update.token_logp(self.actor, mb, mask, self.cfg.rollout.temperature, True)
        if self.measure and step == 0 and mb.scale > 0:  # scale 0: a filler repeating another rank's data
            g = update.micro_gap(t, mb, mask, logp.detach(), self.version, self.cfg.rollout.partial_kv == "keep")
            self.gap = [self.gap[0] + g[0], self.gap[1] + g[1], max(self.gap[2], g[2])]
        on_policy = self.source == "update" or (self.source == "first-update" and step == 0)
        old = logp.detach() if on_policy else cat_tokens(t, mb.indices, "old_logp", dev)
        ref = self.ref_logp(mb, mask) if self.ref_logp is not None else None
        is_weight, m_is = None, {}
        if self.correct:
            # old is the trainer at the sampling weights (the scoring pass, or this forward when on-policy);
            # tokens without exact sample logprobs (a context-window cut) keep weight 1
            exact = torch.cat([torch.full((len(t[i].input_ids),), t[i].logprobs_exact) for i in mb.indices]).to(dev)
            is_weight, m_is = algorithms.offpolicy_weights(old, cat_tokens(t, mb.indices, "sample_logprobs", dev),
                                                           mask & exact, a, cu_seqlens=mb.cu_seqlens)
            hi, lo = float(m_is.pop("actor/is_ratio_max")), float(m_is.pop("actor/is_ratio_min"))
            if bool((mask & exact).any()):  # an empty micro-batch reports the neutral 1
                self.is_range = [max(self.is_range[0], hi), min(self.is_range[1], lo)]
        loss, m = algorithms.policy_loss(logp, old, cat_tokens(t, mb.indices, "advantages", dev), mask, ent, ref, a,
                                         cu_seqlens=mb.cu_seqlens, norm_len=self.norm_len, is_weight=is_weight)
        m.update(m_is)  # the means; the extremes are reduced in finish
        return (loss * float("nan") if self.inject else loss), m

    def before_step(self, step: int) -> None:
        """The parity guard before the first optimiser step moves the weights (collective)."""
        if self.measure and step == 0:
            self.measured = update.reduce_gap(*self.gap, prior=self.prior_gap)  # identical on every rank
            self.check_gap(self.measured)

    def finish(self) -> dict[str, float]:
        """The measured gap and, with a correction, the ratio extremes over every rank (collective)."""
        out = dict(self.measured)
        if self.correct:  # on every rank alike (the config is the same everywhere)
            hi, lo = du.all_reduce_max(self.is_range[0]), -du.all_reduce_max(-self.is_range[1])
            out["actor/is_ratio_max"] = hi if hi != -float("inf") else 1.0
            out["actor/is_ratio_min"] = lo if lo != float("inf") else 1.0
        return out


def actor_loss_components(logp: Tensor, entropy: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                          ref_logp: Tensor | None, cfg: Any, *, cu_seqlens: Tensor | None = None,
                          norm_len: float | None = None) -> dict[str, Tensor]:
    """The ppo actor loss split into its terms (RAGEN-2's gradient analysis), each a differentiable fp32 scalar:
    "task" the clipped policy term (``algorithms.policy_loss`` without entropy and KL), "entropy" =
    -entropy_coef x agg(entropy) (when entropy_coef != 0), "kl" = kl_coef x agg(kl(logp, ref)) (when ref_logp is
    given and kl_coef != 0), agg = ``loss_agg_mode``'s token weights. They sum to ``policy_loss``'s loss.

    logp / entropy fp32 [N] (differentiable), old_logp / advantages / ref_logp fp32 [N], mask bool [N], cfg the
    AlgorithmConfig (policy_loss must be "ppo": other registered losses need not split this way)."""
    if cfg.policy_loss != "ppo":
        raise ValueError(f"loss components exist for algorithm.policy_loss 'ppo' only, got {cfg.policy_loss!r}")
    task_cfg = dataclasses.replace(cfg, entropy_coef=0.0, kl_coef=0.0)
    out = {"task": algorithms.policy_loss(logp, old_logp, advantages, mask, None, None, task_cfg,
                                          cu_seqlens=cu_seqlens, norm_len=norm_len)[0]}
    weights = kernels.reference.aggregation_weights(mask, cfg.loss_agg_mode, cu_seqlens, norm_len)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if cfg.entropy_coef != 0:
        out["entropy"] = -cfg.entropy_coef * (weights * torch.where(mask, entropy, zero)).sum()
    if ref_logp is not None and cfg.kl_coef != 0:
        raw = torch.where(mask, logp - ref_logp, zero)
        kl = raw if cfg.kl_type == "k1" else torch.exp(-raw) + raw - 1.0
        out["kl"] = cfg.kl_coef * (weights * kl).sum()
    return out
