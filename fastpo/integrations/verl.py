"""fastpo's PPO policy loss and advantage estimators in verl's registries (written against verl 0.9.1).

Importing this module registers, under their own names:

* policy loss ``fastpo_ppo`` (``actor_rollout_ref.actor.policy_loss.loss_mode=fastpo_ppo``): verl's ``vanilla``
  loss -- clipped surrogate with clip-higher (``clip_ratio_low`` / ``clip_ratio_high``), dual clip
  (``clip_ratio_c``), ``rollout_is_weights`` -- computed by the ``fastpo::ppo_loss`` op, for every
  ``loss_agg_mode`` (token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm) and
  the actor's ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor); same loss,
  gradient and ``actor/*`` metrics as ``vanilla``;
* advantage estimators (``algorithm.adv_estimator=...``):

  - ``fastpo_grpo``: verl's ``grpo`` (groups by ``uid``; a group of one gets score / (1 + epsilon) as verl);
  - ``fastpo_gae``: verl's ``gae`` (multi-turn: the recursion skips observation tokens), whitened as verl,
    positions off the mask included;
  - ``fastpo_bilevel_gae``: RAGEN's bi-level GAE (turn level over turn-ending rewards, token level inside turns);
  - ``fastpo_gigpo``: GiGPO (episode + step advantages), from per-turn data the agent loop supplies.

verl 0.9.1's ``compute_advantage`` passes registered estimators only ``token_level_rewards``, ``response_mask``,
``index`` and ``config``. ``fastpo_grpo`` needs nothing more; the estimators that read values (``fastpo_gae``,
``fastpo_bilevel_gae``) or turn data (``fastpo_gigpo``) need :func:`patch_compute_advantage` in the driver, which
hands them ``values`` / ``gamma`` / ``lam`` / the turn fields from the batch. Without it they raise a ValueError
saying so. docs/KERNELS.md has the details.
"""

from __future__ import annotations

import importlib
from enum import Enum

import numpy as np
import torch

from fastpo.kernels import functional as F

SUPPORTED_VERL = "0.9"

try:
    from verl.trainer.ppo import core_algos
except ImportError as exc:  # one line, naming what to install
    raise ImportError(f"fastpo.integrations.verl needs verl {SUPPORTED_VERL}.x (pip install --no-deps "
                      f"verl=={SUPPORTED_VERL}.1 and the modules it imports, see the Makefile's PEER_PKGS): "
                      f"{exc}") from None

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS = "fastpo_ppo"
ESTIMATORS_NEEDING_BATCH = ("fastpo_gae", "fastpo_bilevel_gae", "fastpo_gigpo")


# -------------------------------------------------------------------------------------------- aggregation
def agg_weights(loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1, batch_num_tokens=None,
                global_batch_size=None, loss_scale_factor=None) -> torch.Tensor:
    """Per-token weights w (fp32, loss_mask's shape ``[B, T]``) with verl's ``agg_loss(x) == sum(w * x)``.

    token-mean: dp_size / tokens (batch_num_tokens, default the local count); token-sum: dp_size;
    seq-mean-token-sum: dp_size / sequences (global_batch_size, default the local sequences holding a token);
    seq-mean-token-mean: the same divided by each row's token count; seq-mean-token-sum-norm: seq-mean-token-sum
    divided by loss_scale_factor (default T). Off the mask the weight is 0; a batch without a trained token weighs
    0 (verl: 0 / 0 = NaN)."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {loss_agg_mode!r}")
    m = (loss_mask != 0).float()
    if loss_agg_mode in ("token-mean",) + AGG_MODES[2:] and dp_size > 1:
        need = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        if (batch_num_tokens if loss_agg_mode == "token-mean" else global_batch_size) is None:
            raise ValueError(f"(global) {need} is required when dp_size > 1")
    if loss_agg_mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=torch.float32)
        return m * (dp_size / n.to(m.device).clamp(min=1e-30))
    if loss_agg_mode == "token-sum":
        return m * float(dp_size)
    rows = (m.sum(-1) > 0).float().sum() if global_batch_size is None else torch.as_tensor(
        global_batch_size, dtype=torch.float32)
    w = m * (dp_size / rows.to(m.device).clamp(min=1e-30))
    if loss_agg_mode == "seq-mean-token-mean":
        return w / (m.sum(-1, keepdim=True) + 1e-8)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return w / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return w


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None) -> torch.Tensor:
    """verl's ``agg_loss`` (same arguments) as a weighted sum with :func:`agg_weights`."""
    w = agg_weights(loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    return torch.where(loss_mask != 0, w * loss_mat, 0.0).sum()


# ------------------------------------------------------------------------------------------ policy loss
def _cfg(config, key, default=None):
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def compute_policy_loss_fastpo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                               rollout_is_weights: torch.Tensor | None = None):
    """verl's policy-loss signature; the ``vanilla`` loss through the fastpo::ppo_loss op. Returns (loss,
    {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}) as ``vanilla``."""
    if config is None:
        raise ValueError("fastpo_ppo needs the actor config (clip_ratio, clip_ratio_low / high, clip_ratio_c)")
    clip = _cfg(config, "clip_ratio", 0.2)
    low, high = _cfg(config, "clip_ratio_low", clip), _cfg(config, "clip_ratio_high", clip)
    clip_c = _cfg(config, "clip_ratio_c", 3.0)
    info = dict(_cfg(config, "global_batch_info", {}) or {})
    weights = agg_weights(response_mask, loss_agg_mode, **info)
    is_weight = rollout_is_weights.detach().float() if rollout_is_weights is not None else None
    loss, stats = F.policy_loss(log_prob, old_log_prob, advantages, response_mask, weights, low, high, clip_c, None,
                                0.0, "k1", None, 0.0, is_weight)
    metrics = F.ppo_metrics(stats, False, False)
    return loss, {"actor/pg_clipfrac": metrics["clipfrac"].item(), "actor/ppo_kl": metrics["approx_kl"].item(),
                  "actor/pg_clipfrac_lower": metrics["clipfrac_lower"].item()}


# ------------------------------------------------------------------------------------------- advantages
def _group_ids(index, device) -> torch.Tensor:
    """verl's ``uid`` array (any hashable labels) -> int64 group ids."""
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.int64, device=device)


def compute_grpo_advantage_fastpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool | None = None, config=None,
                                  **_):
    """verl's ``grpo``: per ``uid`` group (R - mean) / (std + epsilon) (unbiased std), or R - mean, on the response
    tokens; a group of one gets R / (1 + epsilon) (R without the std), as verl's mean 0 / std 1. Returns
    (advantages, returns), the same tensor twice, as verl."""
    norm = norm_adv_by_std_in_grpo if norm_adv_by_std_in_grpo is not None else bool(
        _cfg(config, "norm_adv_by_std_in_grpo", True))
    scores = token_level_rewards.sum(-1)
    groups = _group_ids(index, scores.device)
    adv = F.grpo_advantages(scores, groups, response_mask, norm_by_std=norm, eps=float(epsilon))
    sizes = torch.bincount(groups, minlength=int(groups.max()) + 1 if groups.numel() else 0)[groups]
    single = (scores / (1.0 + epsilon) if norm else scores).float()
    adv = torch.where((sizes == 1)[:, None], single[:, None] * (response_mask != 0), adv)
    return adv, adv


def _need(name: str, value, what: str):
    if value is None:
        raise ValueError(f"{name} needs {what}: verl's compute_advantage passes registered estimators only "
                         "token_level_rewards / response_mask / index / config; call "
                         "fastpo.integrations.verl.patch_compute_advantage() in the driver")
    return value


def _verl_whiten(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten (unbiased var, rsqrt(var + 1e-8)) over the masked entries, applied to every entry."""
    mf = m.float()
    n = mf.sum()
    if n.item() < 2:
        raise ValueError("whitening needs at least 2 trained tokens in the batch (verl's masked_whiten too)")
    mean = (x * mf).sum() / (n + 1e-8)
    var = (((x - mean) ** 2) * mf).sum() / (n + 1e-8) * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _fill_from_next_trained(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Every untrained position takes the value of the next trained position in its row (0 when none): what
    verl's GAE loop carries over observation tokens."""
    t = m.shape[-1]
    pos = torch.where(m, torch.arange(t, device=m.device), t)
    nxt = pos.flip(-1).cummin(-1).values.flip(-1)
    padded = torch.nn.functional.pad(x, (0, 1))
    return padded.gather(-1, nxt)


def compute_gae_advantage_fastpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                 values: torch.Tensor | None = None, gamma=None, lam=None, config=None, **_):
    """verl's ``gae`` (``compute_gae_advantage_return``): multi-turn GAE whose recursion skips untrained tokens
    (their rewards and values unread), scanned by fastpo; returns = A + V and A whitened over the trained tokens,
    every position filled as verl's loop leaves it (an untrained position carries the next trained one's A)."""
    values = _need("fastpo_gae", values, "the critic's values")
    gamma = float(_cfg(config, "gamma", 1.0) if gamma is None else gamma)
    lam = float(_cfg(config, "lam", 1.0) if lam is None else lam)
    m = response_mask != 0
    with torch.no_grad():
        adv, _ = F.gae_advantages(token_level_rewards * m, values, m, gamma, lam, whiten=False)
        adv = _fill_from_next_trained(adv, m).to(values.dtype)
        returns = adv + values
        return _verl_whiten(adv, m), returns


def compute_bilevel_gae_advantage_fastpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         values: torch.Tensor | None = None, gamma=None, lam=None, config=None,
                                         turn_end: torch.Tensor | None = None, gamma_high: float | None = None,
                                         lam_high: float | None = None, **_):
    """Bi-level GAE (RAGEN): a turn-level GAE (gamma_high, lam_high) over turn returns, a token-level GAE
    (gamma, lam) inside each turn. ``turn_end`` ([B, T] bool, last token of each turn) or, when None, RAGEN's
    rule: a turn ends at every trained token holding a reward. gamma_high defaults to config's
    ``bilevel_gamma_high`` or 0.95. Returns (advantages whitened over trained tokens, returns), 0 off the mask."""
    values = _need("fastpo_bilevel_gae", values, "the critic's values")
    gamma = float(_cfg(config, "gamma", 1.0) if gamma is None else gamma)
    lam = float(_cfg(config, "lam", 1.0) if lam is None else lam)
    gamma_high = float(_cfg(config, "bilevel_gamma_high", 0.95) if gamma_high is None else gamma_high)
    m = response_mask != 0
    with torch.no_grad():
        turns = "turn_end" if turn_end is not None else "reward"
        te = turn_end if turn_end is not None else torch.zeros_like(m)
        return F.bilevel_gae_advantages(token_level_rewards, values, m, te, gamma, lam, gamma_high, lam_high,
                                        turns=turns)


def compute_gigpo_advantage_fastpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                   turn_ids: torch.Tensor | None = None, turn_keys=None, turn_rewards=None,
                                   step_weight: float | None = None, step_gamma: float | None = None,
                                   norm_adv_by_std_in_grpo: bool | None = None, epsilon: float = 1e-6, config=None,
                                   **_):
    """GiGPO: per turn, episode advantage (GRPO over ``uid`` groups of the summed rewards) + step_weight * step
    advantage (the turn's discounted return normalised within the turns of the group that start from the same
    state key). Per row b: ``turn_ids[b, t]`` the turn (0, 1, ...) of token t or -1, ``turn_keys[b]`` /
    ``turn_rewards[b]`` that row's per-turn state keys (int) and rewards (lists, as verl's non_tensor_batch
    holds them). step_weight / step_gamma default to config's ``gigpo_step_weight`` (1.0) / ``gigpo_step_gamma``
    (0.95). Returns (advantages, advantages), 0 off the mask."""
    turn_ids = _need("fastpo_gigpo", turn_ids, "turn_ids / turn_keys / turn_rewards from the agent loop")
    _need("fastpo_gigpo", turn_keys, "turn_keys")
    _need("fastpo_gigpo", turn_rewards, "turn_rewards")
    norm = norm_adv_by_std_in_grpo if norm_adv_by_std_in_grpo is not None else bool(
        _cfg(config, "norm_adv_by_std_in_grpo", True))
    step_weight = float(_cfg(config, "gigpo_step_weight", 1.0) if step_weight is None else step_weight)
    step_gamma = float(_cfg(config, "gigpo_step_gamma", 0.95) if step_gamma is None else step_gamma)
    dev = token_level_rewards.device
    counts = torch.tensor([len(k) for k in turn_keys], dtype=torch.int64, device=dev)
    cu_turns = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    keys = torch.tensor([int(k) for row in turn_keys for k in row], dtype=torch.int64, device=dev)
    rewards = torch.tensor([float(r) for row in turn_rewards for r in row], dtype=torch.float32, device=dev)
    local = turn_ids.to(dev).long()
    global_ids = torch.where(local >= 0, local + cu_turns[:-1, None], -1)
    with torch.no_grad():
        adv, _, _ = F.gigpo_advantages(token_level_rewards.sum(-1).float(), _group_ids(index, dev), keys, rewards,
                                       cu_turns, global_ids.reshape(-1), response_mask.reshape(-1), step_weight,
                                       step_gamma, norm, float(epsilon))
    adv = adv.view(response_mask.shape)
    return adv, adv


# ------------------------------------------------------------------------------------- registration
ESTIMATORS = {
    "fastpo_grpo": compute_grpo_advantage_fastpo,
    "fastpo_gae": compute_gae_advantage_fastpo,
    "fastpo_bilevel_gae": compute_bilevel_gae_advantage_fastpo,
    "fastpo_gigpo": compute_gigpo_advantage_fastpo,
}


def register() -> None:
    """Put fastpo's functions into verl's registries (done on import; idempotent)."""
    core_algos.register_policy_loss(POLICY_LOSS)(compute_policy_loss_fastpo)
    for name, fn in ESTIMATORS.items():
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
            core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)  # a reload: replace the old function object
            core_algos.register_adv_est(name)(fn)


register()


# ------------------------------------------------------------------------------ compute_advantage routing
BATCH_FIELDS = ("values", "turn_end", "turn_ids")
NON_TENSOR_FIELDS = ("turn_keys", "turn_rewards")


def compute_advantage_routed(original, data, adv_estimator, gamma: float = 1.0, lam: float = 1.0,
                             num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True, config=None):
    """verl's ``compute_advantage`` (``original``) for every estimator but the fastpo ones that read values or
    turn data: those get ``values`` / ``turn_end`` / ``turn_ids`` from ``data.batch``, ``turn_keys`` /
    ``turn_rewards`` / ``uid`` from ``data.non_tensor_batch``, and gamma / lam / norm_adv_by_std_in_grpo."""
    name = adv_estimator.value if isinstance(adv_estimator, Enum) else adv_estimator
    if name not in ESTIMATORS_NEEDING_BATCH:
        return original(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
    if "response_mask" not in data.batch.keys():
        raise ValueError(f"{name} needs data.batch['response_mask']")
    kwargs = dict(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
                  gamma=gamma, lam=lam, config=config)
    keys = set(data.batch.keys())
    kwargs.update({k: data.batch[k] for k in BATCH_FIELDS if k in keys})
    kwargs.update({k: data.non_tensor_batch[k] for k in NON_TENSOR_FIELDS if k in data.non_tensor_batch})
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if name == "fastpo_gigpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    advantages, returns = core_algos.get_adv_estimator_fn(name)(**kwargs)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


PATCH_TARGETS = ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.utils",
                 "verl.experimental.separation.ray_trainer")


def patch_compute_advantage(modules=PATCH_TARGETS) -> list[str]:
    """Route verl's ``compute_advantage`` through :func:`compute_advantage_routed` in each of ``modules`` (names
    or module objects) that imports (the driver's trainer modules). Returns the names patched; idempotent."""
    patched = []
    for mod in modules:
        if isinstance(mod, str):
            try:
                mod = importlib.import_module(mod)
            except ImportError:
                continue
        original = getattr(mod, "compute_advantage", None)
        if original is None:
            continue
        if getattr(original, "_fastpo_routed", False):
            patched.append(mod.__name__)
            continue

        def routed(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True,
                   config=None, _original=original):
            return compute_advantage_routed(_original, data, adv_estimator, gamma, lam, num_repeat,
                                            norm_adv_by_std_in_grpo, config)

        routed._fastpo_routed = True
        mod.compute_advantage = routed
        patched.append(mod.__name__)
    return patched
