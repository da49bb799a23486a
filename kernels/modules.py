"""Drop-in nn.Modules with Liger / TRL argument order and strings.

``FastPOFusedLinearGRPOLoss`` replaces ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (and TRL's
``GRPOTrainer._compute_loss``): it takes the last hidden states and the lm-head weight, never builds the
[B, T, V] logits, and returns ``(loss, metrics)`` with Liger's metrics list ``[kl_mean (when beta != 0),
clip_ratio]``. ``FastPOGRPOLoss`` is the same loss on given logits. TRL's per-token loss is
``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) + beta * k3`` with k3 = exp(ref - logp) - (ref - logp)
- 1 (no dual clip; fastpo clamps the log-ratio to +-20), normalised per ``loss_type``:

* ``grpo``: mean over sequences of each sequence's token mean;
* ``bnpo``: sum over masked tokens / number of masked tokens;
* ``dr_grpo``: sum / (B * max_completion_length);
* ``dapo``: sum / (masked tokens of the global batch / world size): equals bnpo on one process.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import functional as F

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def trl_loss_weights(mask: Tensor, loss_type: str, max_completion_length: int | None) -> Tensor:
    """Per-token weights (fp32, mask's shape [B, T]) for TRL's loss_type normalisations."""
    m = (mask != 0).float()
    if loss_type == "grpo":
        return m / (m.sum(1, keepdim=True).clamp(min=1.0) * max(m.shape[0], 1))
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return m / (m.shape[0] * max_completion_length)
    if loss_type == "dapo":
        count = m.sum()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            count = count.clone()
            torch.distributed.all_reduce(count)
            count = count / torch.distributed.get_world_size()
        return m / count.clamp(min=1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


class _GRPOLossBase(nn.Module):
    def __init__(self, beta: float = 0.04, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 loss_type: str = "bnpo", temperature: float = 1.0, max_completion_length: int | None = None, *,
                 use_ref_model: bool = True, compiled: bool = True, chunk_size: int = 1,
                 importance_sampling_level: str = "token"):
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
            raise ValueError(f"max_completion_length must be a positive int for loss_type='dr_grpo', "
                             f"got {max_completion_length!r}")
        if importance_sampling_level != "token":
            raise ValueError(f"importance_sampling_level must be 'token', got {importance_sampling_level!r}")
        self.beta = float(beta)
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.loss_type = loss_type
        self.temperature = float(temperature)
        self.max_completion_length = max_completion_length
        self.use_ref_model = use_ref_model
        self.compiled, self.chunk_size = compiled, chunk_size  # accepted for Liger compatibility; unused

    def _loss(self, logp: Tensor, completion_mask: Tensor, advantages: Tensor, ref_logp: Tensor | None,
              old_logp: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        if completion_mask.dim() != 2 or tuple(completion_mask.shape) != tuple(logp.shape):
            raise ValueError(f"completion_mask must be [B, T] = {tuple(logp.shape)}, got "
                             f"{tuple(completion_mask.shape)}")
        use_kl = self.beta != 0.0 and self.use_ref_model
        if use_kl and ref_logp is None:
            raise ValueError("ref_logp (or ref_input + ref_weight) is required when beta != 0 and use_ref_model")
        old = logp.detach() if old_logp is None else old_logp
        weights = trl_loss_weights(completion_mask, self.loss_type, self.max_completion_length)
        loss, stats = F.policy_loss(logp, old, advantages, completion_mask, weights, self.epsilon_low,
                                    self.epsilon_high, math.inf, ref_logp if use_kl else None,
                                    self.beta if use_kl else 0.0, "k3", None, 0.0)
        metrics = F.ppo_metrics(stats, False, use_kl)
        return loss, ([metrics["kl"]] if use_kl else []) + [metrics["clipfrac"]]


class FastPOFusedLinearGRPOLoss(_GRPOLossBase):
    """GRPO loss fused with the lm head (Liger's ``LigerFusedLinearGRPOLoss`` interface).

    Args: beta (KL coefficient; 0 disables the reference model), epsilon_low / epsilon_high (clip range),
    loss_type ("grpo" | "bnpo" | "dr_grpo" | "dapo"), temperature (logits are divided by it),
    max_completion_length (required by dr_grpo). Liger's ``compiled``, ``chunk_size`` are accepted and ignored.

    forward(hidden [B, T, H], lm_head_weight [V, H], completion_ids [B, T] int, completion_mask [B, T],
    advantages [B] or [B, T], bias [V] = None, ref_logp [B, T] = None, old_logp [B, T] = None,
    ref_input [B, T, H] = None, ref_weight [V, H] = None, ref_bias [V] = None) -> (loss fp32 [],
    [kl_mean (beta != 0), clip_ratio]). old_logp None means on-policy (ratio 1). ref_input/ref_weight compute
    ref_logp (no grad) when ref_logp is not given."""

    def forward(self, hidden: Tensor, lm_head_weight: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                advantages: Tensor, bias: Tensor | None = None, ref_logp: Tensor | None = None,
                old_logp: Tensor | None = None, ref_input: Tensor | None = None, ref_weight: Tensor | None = None,
                ref_bias: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
        logp = F.fused_linear_logprob(hidden, lm_head_weight, completion_ids, bias, self.temperature)
        if ref_logp is None and ref_input is not None and self.beta != 0.0 and self.use_ref_model:
            if ref_weight is None:
                raise ValueError("ref_weight is required with ref_input")
            with torch.no_grad():
                ref_logp = F.fused_linear_logprob(ref_input, ref_weight, completion_ids, ref_bias, self.temperature)
        return self._loss(logp, completion_mask, advantages, ref_logp, old_logp)


class FastPOGRPOLoss(_GRPOLossBase):
    """The same GRPO loss on given logits: forward(logits [B, T, V] (aligned with completion_ids: slice off the
    prompt and the last position first; a [B, T, V] view is read in place), completion_ids [B, T],
    completion_mask [B, T], advantages [B] or [B, T], ref_logp = None, old_logp = None) -> (loss, metrics)."""

    def forward(self, logits: Tensor, completion_ids: Tensor, completion_mask: Tensor, advantages: Tensor,
                ref_logp: Tensor | None = None, old_logp: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        if logits.dim() != 3:
            raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
        logp = F.selective_logprob(logits, completion_ids, self.temperature)
        return self._loss(logp, completion_mask, advantages, ref_logp, old_logp)
