"""fastpo's fused logprob and PPO loss inside TRL's ``GRPOTrainer`` (supported: trl 1.16.x).

Use it in place of ``GRPOTrainer``, with the same arguments::

    from fastpo.integrations.trl import FastPOGRPOTrainer
    trainer = FastPOGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

What fastpo computes (everything else -- generation, rewards, advantages, when old / reference logprobs are taken,
the vLLM importance-sampling ratio, logging -- is TRL's own code, unchanged):

* every per-token logprob the trainer takes (policy, old policy, reference) and the policy's entropy: the
  decoder's hidden states times the lm-head weight through ``fastpo.kernels.fused_linear_logprob``, on the scored
  (completion) positions only. The ``[B, T, V]`` logits are never built. It replaces the fused LM head TRL patches
  into ``model.forward`` (same call, ``model(..., labels=..., fused_lm_head=True)``), so DDP / PEFT wrappers and
  TRL's batching keep working;
* the policy loss: the ``fastpo::ppo_loss`` op (clipped surrogate; GRPOConfig ``delta`` is its dual clip; the KL
  term k3 to the reference; off-policy mask, high-entropy mask and vLLM IS ratio as per-token weights), with each
  ``loss_type``'s normalisation (and gradient accumulation) as per-token aggregation weights.

It logs what TRL logs, under TRL's names (``kl``, ``entropy``, ``clip_ratio/*``, ``policy_loss`` and
``entropy_coef`` with an entropy bonus). Options it cannot honour are refused at construction with one line
(:class:`UnsupportedOption`) naming the option and value; the list is :data:`HONOURED` / :data:`REFUSED` and
docs/KERNELS.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import os
import types
import warnings

import torch

from fastpo.kernels import functional as F

SUPPORTED_TRL = "1.16"  # major.minor; the loss below mirrors this release's GRPOTrainer._compute_loss

try:
    import trl
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as exc:  # one line, naming what to install
    raise ImportError(f"fastpo.integrations.trl needs trl {SUPPORTED_TRL}.x (pip install --no-deps "
                      f"trl=={SUPPORTED_TRL}.0 and its deps, see the Makefile's TRL_PKGS): {exc}") from None

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

HONOURED = (
    "loss_type in grpo / bnpo / dr_grpo / dapo / luspo", "beta (with a reference model or PEFT adapter disabled)",
    "use_bias_correction_kl", "epsilon", "epsilon_high", "delta (>= 1 + epsilon_high)",
    "importance_sampling_level token / sequence (GSPO)", "num_iterations", "steps_per_generation",
    "gradient_accumulation_steps", "temperature", "max_completion_length", "mask_truncated_completions",
    "top_entropy_quantile", "off_policy_mask_threshold", "entropy_coef", "use_adaptive_entropy (entropy_target, "
    "entropy_coef_min / max / delta)",
    "use_vllm + vllm_importance_sampling_correction (every vllm_importance_sampling_mode)", "cast_lm_head_to_fp32",
    "tools (tool_mask)", "and every option that acts before the loss (generation, rewards, scale_rewards, ...)",
)
REFUSED = (
    "loss_type cispo / sapo / vespo", "delta < 1 + epsilon_high",
    "a MoE router aux loss (router_aux_loss_coef != 0 on a router model)",
    "models whose logits are transformed (final_logit_softcapping, logit_scale, ...)", "DeepSpeed ZeRO-3",
    f"trl releases other than {SUPPORTED_TRL}.x (FASTPO_TRL_UNTESTED=1 turns the refusal into a warning)",
)
# config attributes that make a model's logits something else than hidden @ W^T + b (TRL's fused head applies
# them; fastpo's kernel does not)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")

# Set while the trainer asks for entropies (the loss step); the patched forward computes them only then.
_WANT_ENTROPY = contextvars.ContextVar("fastpo_want_entropy", default=False)


class UnsupportedOption(ValueError):
    """A trainer option, model property or trl release the integration cannot honour; raised at construction."""


def _refuse(option: str, value, why: str):
    raise UnsupportedOption(f"FastPOGRPOTrainer cannot honour {option}={value!r}: {why}")


def check_trl_version(version: str) -> None:
    """Refuse (or, with FASTPO_TRL_UNTESTED=1, warn about) a trl release other than :data:`SUPPORTED_TRL`."""
    if ".".join(version.split(".")[:2]) == SUPPORTED_TRL:
        return
    msg = (f"FastPOGRPOTrainer supports trl {SUPPORTED_TRL}.x, found trl {version}: its loss mirrors trl "
           f"{SUPPORTED_TRL}'s GRPOTrainer._compute_loss (options, normalisations, metrics), which other releases "
           "change (FASTPO_TRL_UNTESTED=1 runs it anyway)")
    if os.environ.get("FASTPO_TRL_UNTESTED") == "1":
        warnings.warn(msg, stacklevel=3)
        return
    raise UnsupportedOption(msg)


def check_config(args) -> None:
    """Refuse the GRPOConfig options the fastpo loss does not compute (one line naming option and value)."""
    if args.loss_type not in LOSS_TYPES:
        _refuse("GRPOConfig.loss_type", args.loss_type, f"fastpo's loss op computes the clipped loss types "
                f"{LOSS_TYPES}")
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.delta is not None and not (args.delta >= 1.0 + eps_high and args.delta > 1.0):
        _refuse("GRPOConfig.delta", args.delta, f"two-sided clipping is fastpo's dual clip, the same loss only for "
                f"delta >= 1 + epsilon_high = {1.0 + eps_high}")
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", None) == 3:
        _refuse("GRPOConfig.deepspeed zero_stage", 3, "the fused backward re-reads the lm-head weight outside its "
                "module's ZeRO-3 gather hook")


def check_model(model) -> None:
    """Refuse a model whose logits are not plain hidden @ W^T + b (softcapping, logit scales)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and not (attr != "final_logit_softcapping" and value == 1.0):
            _refuse(f"model config {attr}", value, "fastpo's fused logprob takes plain logits hidden @ W^T + b")


# ------------------------------------------------------------------------------------------------ the LM head
def add_fastpo_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                       entropy: bool = True) -> None:
    """Patch ``model.forward`` so that ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` with ``log_probs`` (and ``entropy`` while the trainer asks for it) from fastpo's fused
    kernel: backbone hidden states of the positions whose next-token label is not -100, times the lm-head weight,
    tiled over the vocab. Any other call goes to the forward that was there before (TRL's, or the model's own), so
    generation is unchanged. ``temperature`` divides the logits; ``entropy=False`` never computes entropies (the
    reference model)."""
    previous = model.forward
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:  # pragma: no cover - every supported trl has it
        maybe_gather_lm_head_ctx = None

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against the forward's signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                       ("num_items_in_batch", num_items_in_batch)) if v is not None}
            return previous(*args, **kwargs, **extra)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        weight, bias = head.weight, head.bias
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor shards: gather the head for the projection
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        mask = labels != -100
        x, ids = hidden[mask], labels[mask]
        if cast_lm_head_to_fp32:
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        elif weight.dtype != x.dtype:  # autocast: project in the activations' dtype (the kernel accumulates in fp32)
            weight = weight.to(x.dtype)
            bias = bias.to(x.dtype) if bias is not None else None
        want = entropy and _WANT_ENTROPY.get()
        gather = maybe_gather_lm_head_ctx(head.weight, head.bias) if maybe_gather_lm_head_ctx else None
        with gather or contextlib.nullcontext(), torch.autocast(x.device.type, enabled=False):
            out = F.fused_linear_logprob(x, weight, ids, bias, temperature, return_entropy=want)
        logp, ent = out if want else (out, None)
        # masked_scatter keeps an all-masked batch connected to the graph (a differentiable zero)
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        ent_full = ent.new_zeros(mask.shape).masked_scatter(mask, ent) if ent is not None else None
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=ent_full,
                                   label_mask=mask)

    model.forward = types.MethodType(forward, model)


# ----------------------------------------------------------------------------------------------- the trainer
def _nanmin(x: torch.Tensor) -> torch.Tensor:
    kept = x[~torch.isnan(x)]
    return kept.min() if kept.numel() else torch.tensor(float("nan"), device=x.device)


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    kept = x[~torch.isnan(x)]
    return kept.max() if kept.numel() else torch.tensor(float("nan"), device=x.device)


class FastPOGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with fastpo's fused logprob and PPO loss op (module docstring). Same arguments."""

    def __init__(self, *args, **kwargs):
        check_trl_version(trl.__version__)
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is not None:  # None: TRL builds a default GRPOConfig, whose options are all honoured
            check_config(config)
        super().__init__(*args, **kwargs)
        check_config(self.args)
        check_model(self.model)
        if self.aux_loss_enabled:
            _refuse("GRPOConfig.router_aux_loss_coef", self.router_aux_loss_coef, "the MoE load-balancing loss needs "
                    "the router logits, which the fastpo head does not request")
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        add_fastpo_lm_head(policy, self.temperature, self.args.cast_lm_head_to_fp32, entropy=True)
        if self.ref_model is not None:
            add_fastpo_lm_head(self.ref_model, self.temperature, self.args.cast_lm_head_to_fp32, entropy=False)

    def _get_per_token_logps_and_entropies(self, *args, compute_entropy=False, **kwargs):
        token = _WANT_ENTROPY.set(bool(compute_entropy))
        try:
            return super()._get_per_token_logps_and_entropies(*args, compute_entropy=compute_entropy, **kwargs)
        finally:
            _WANT_ENTROPY.reset(token)

    # ------------------------------------------------------------------------------------------- loss pieces
    def _loss_weights(self, mask: torch.Tensor, inputs, mode: str) -> tuple[torch.Tensor, float]:
        """Per-token aggregation weights of TRL's loss_type normalisation (gradient accumulation included) and
        the factor that turns the weighted sum back into TRL's logged ``policy_loss``."""
        m = mask.float()
        accum = float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0
        batch = m.shape[0]
        if self.loss_type == "grpo":
            return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * batch * accum), accum
        if self.loss_type == "bnpo":
            return m / (m.sum().clamp(min=1.0) * accum), accum
        if self.loss_type == "dr_grpo":
            return m / (batch * self.max_completion_length * accum), accum
        if self.loss_type == "luspo":
            return m / (batch * accum), accum
        # dapo: num_items_in_batch spans the generation batch; rescaled to one accumulation window, no 1 / accum
        norm = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            norm = norm * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return m / norm, 1.0

    def _masked_mean_metric(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Masked mean over the global batch; a [B, 1] x is one value per sequence (sequence-level ratios)."""
        if x.shape[1] == 1:
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            local = torch.stack([(x * mask).sum(), mask.sum().float()])
        total = self.accelerator.reduce(local, reduction="sum")
        return (total[0] / total[1].clamp(min=1.0)).item()

    def _seq_mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def _entropy_bonus(self, entropy: torch.Tensor, eff: torch.Tensor, mode: str) -> torch.Tensor:
        """coef * (mean entropy over the tokens the policy term acts on) / accumulation, TRL's bonus. Adaptive
        control: the coefficient applied is the one set at the end of the previous optimiser step (0 while the
        window's entropy was above entropy_target); each train micro-batch adds its entropy sum and token count to
        the window, and at the optimiser-step boundary the coefficient moves by entropy_coef_delta, up (capped at
        entropy_coef_max) when the window's global mean entropy is at or below the target, else down (floored at
        entropy_coef_min)."""
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        mean_entropy = (entropy * eff).sum() / eff.sum().clamp(min=1.0) / accum
        coef = self.entropy_coef
        if self.use_adaptive_entropy:
            coef = coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            if mode == "train":
                window = torch.stack([(entropy * eff).sum(), eff.sum()]).detach()
                prev = self._entropy_window_stats
                self._entropy_window_stats = window if prev is None else prev + window
                if self.accelerator.sync_gradients:
                    total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                    world = (total[0] / total[1].clamp(min=1.0)).item()
                    a = self.args
                    if world <= a.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
                    self._last_world_entropy = world
                    self._entropy_window_stats = None
        return coef * mean_entropy

    def _compute_loss(self, model, inputs):
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        extra = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
        logp, entropy, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            **{k: inputs.get(k) for k in extra})
        mode = "train" if self.model.training else "eval"
        shape = logp.shape
        m = mask.float()

        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old

        # per-token weights of the clipped term (constants): off-policy sequence mask, high-entropy mask, vLLM IS
        is_weight = None

        def times(w):
            nonlocal is_weight
            w = w.to(torch.float32).expand(shape)
            is_weight = w if is_weight is None else is_weight * w

        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old)
            times(self.get_off_policy_mask(adv, logp, sampling, mask, self.off_policy_mask_threshold))
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropy, mask, 1 - self.top_entropy_quantile)
            times(entropy_mask)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            times(inputs["importance_sampling_ratio"])

        # the ratio the clipped term sees: per token, or one per sequence (GSPO) fed to the op as a [B, T] log-ratio
        log_ratio = logp - old
        if self.importance_sampling_level == "sequence":
            seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
            op_logp, op_old, ratio_log = seq.expand(shape).contiguous(), torch.zeros_like(logp), seq
        else:
            op_logp, op_old, ratio_log = logp, old, log_ratio
        clip_c = math.inf if self.args.delta is None else float(self.args.delta)

        weights, policy_scale = self._loss_weights(mask, inputs, mode)
        per_token_kl = None
        kl_in_op = False
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * torch.exp(ratio_log)
            else:
                kl_in_op = self.importance_sampling_level == "token"
        loss, _stats = F.policy_loss(
            op_logp, op_old, adv.expand(shape), mask, weights, self.epsilon_low, self.epsilon_high, clip_c,
            inputs["ref_per_token_logps"] if kl_in_op else None, self.beta if kl_in_op else 0.0, "k3", None, 0.0,
            is_weight.contiguous() if is_weight is not None else None)
        if per_token_kl is not None and not kl_in_op:
            loss = loss + self.beta * (weights * per_token_kl).sum()
        policy_loss = loss.detach() * policy_scale

        if self._entropy_bonus_enabled:
            loss = loss - self._entropy_bonus(entropy, m if entropy_mask is None else m * entropy_mask, mode)
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

        # TRL's metrics, TRL's names and meanings
        with torch.no_grad():
            if per_token_kl is not None:
                self._metrics[mode]["kl"].append(self._masked_mean_metric(per_token_kl.detach(), m))
            self._metrics[mode]["entropy"].append(self._masked_mean_metric(entropy.detach(), m))
            ratio = torch.exp(ratio_log.detach())
            if self.args.delta is not None:
                ratio = ratio.clamp(max=self.args.delta)
            low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
            high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
            region = ((low + high) > 0).float()
            metrics = self._metrics[mode]
            metrics["clip_ratio/low_mean"].append(self._masked_mean_metric(low, m))
            metrics["clip_ratio/high_mean"].append(self._masked_mean_metric(high, m))
            metrics["clip_ratio/region_mean"].append(self._masked_mean_metric(region, m))
            metrics["clip_ratio/low_min"].append(_nanmin(self.accelerator.gather(self._seq_mean(low, m))).item())
            metrics["clip_ratio/high_max"].append(_nanmax(self.accelerator.gather(self._seq_mean(high, m))).item())
        return loss
