"""fastpo.integrations.verl next to verl's own functions, on CPU: the registered policy loss against verl's
``vanilla`` loss (and the deprecated ``compute_policy_loss``), ``agg_loss`` in every mode, the estimators against
``compute_gae_advantage_return`` / ``compute_grpo_outcome_advantage``, on random batches with an empty row, a
one-token row, multi-turn masks and a batch without any trained token. Skipped when verl is not importable."""

from __future__ import annotations

import importlib
import itertools
import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.workers.config import ActorConfig  # noqa: E402

from fastpo.integrations import verl as fv  # noqa: E402
from fastpo.kernels import functional as F  # noqa: E402

B, T = 7, 11


def masks(seed: int, multi_turn: bool = True) -> torch.Tensor:
    """[B, T] bool: ragged responses, row 1 empty, row 2 a single token; multi-turn rows have gaps (observations)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, T, generator=g) < (0.7 if multi_turn else 2.0)
    lengths = torch.tensor([11, 0, 1, 6, 9, 3, 11])
    m &= torch.arange(T)[None] < lengths[:, None]
    m[2] = False
    m[2, 0] = True
    m[0, :3] = True
    return m


def actor_config(low=0.2, high=0.28, clip_c=3.0, **info) -> ActorConfig:
    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=0.2,
                      clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c)
    cfg.global_batch_info.update(info)
    return cfg


def policy_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 1.0 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, T, generator=g) * 2
    isw = torch.rand(B, T, generator=g) * 2
    with torch.no_grad():  # row 0 starts with 3 trained tokens: one dual-clipped, one clipped above
        logp[0, 0], adv[0, 0] = old[0, 0] + 2.0, -1.0
        logp[0, 1], adv[0, 1] = old[0, 1] + 0.6, 1.0
    return old, logp, adv, isw


INFOS = {
    "local": {},
    "dp2": dict(dp_size=2, batch_num_tokens=60, global_batch_size=12),
    "scale": dict(loss_scale_factor=16),
}


def run_loss(fn, old, logp, adv, mask, mode, cfg, isw):
    logp.grad = None
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=mode,
                       config=cfg, rollout_is_weights=isw)
    loss.backward()
    return loss.detach(), logp.grad.clone(), metrics


CLIPS = {"symmetric": (0.2, 0.2, 3.0), "clip-higher": (0.2, 0.28, 3.0), "wide-dual1.5": (0.1, 0.4, 1.5)}


@pytest.mark.parametrize("mode,info,clip,use_isw", list(itertools.product(fv.AGG_MODES, INFOS, CLIPS, [False, True])))
def test_policy_loss_matches_vanilla(mode, info, clip, use_isw):
    low, high, clip_c = CLIPS[clip]
    cfg = actor_config(low, high, clip_c, **INFOS[info])
    mask = masks(sum(map(ord, mode + info)))
    old, logp, adv, isw = policy_inputs(3)
    isw = isw if use_isw else None
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    fastpo = core_algos.get_policy_loss_fn("fastpo_ppo")
    assert fastpo is fv.compute_policy_loss_fastpo
    l0, g0, m0 = run_loss(vanilla, old, logp, adv, mask, mode, cfg, isw)
    l1, g1, m1 = run_loss(fastpo, old, logp, adv, mask, mode, cfg, isw)
    torch.testing.assert_close(l1, l0.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g1, g0, atol=1e-7, rtol=1e-5)
    assert set(m0) == set(m1)
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], abs=1e-6), key
    assert m0["actor/pg_clipfrac"] > 0 and m0["actor/pg_clipfrac_lower"] > 0  # both clips exercised


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_matches_deprecated_compute_policy_loss(mode):
    mask = masks(5)
    old, logp, adv, _ = policy_inputs(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pg, clipfrac, ppo_kl, lower = core_algos.compute_policy_loss(old, logp, adv, mask, cliprange=0.2,
                                                                     cliprange_high=0.3, clip_ratio_c=3.0,
                                                                     loss_agg_mode=mode)
    loss, metrics = fv.compute_policy_loss_fastpo(old, logp, adv, mask, mode, actor_config(0.2, 0.3, 3.0))
    torch.testing.assert_close(loss, pg.float(), atol=1e-6, rtol=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac.item(), abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(ppo_kl.item(), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(lower.item(), abs=1e-6)


def test_policy_loss_without_trained_tokens_is_zero():
    """verl's token-mean divides 0 by 0 tokens (NaN); fastpo's weights are 0 there: loss 0, gradient 0."""
    old, logp, adv, _ = policy_inputs(6)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for mode in fv.AGG_MODES:
        l0, _, _ = run_loss(core_algos.get_policy_loss_fn("vanilla"), old, logp, adv, mask, mode, actor_config(), None)
        l1, g1, m1 = run_loss(fv.compute_policy_loss_fastpo, old, logp, adv, mask, mode, actor_config(), None)
        assert l1.item() == 0.0 and not g1.any() and all(v == 0.0 for v in m1.values())
        assert l0.item() == 0.0 or math.isnan(l0.item())


@pytest.mark.parametrize("mode,info", list(itertools.product(fv.AGG_MODES, INFOS)))
def test_agg_loss_matches_verl(mode, info):
    g = torch.Generator().manual_seed(7)
    loss_mat = torch.randn(B, T, generator=g)
    mask = masks(8)
    expected = core_algos.agg_loss(loss_mat, mask, mode, **INFOS[info])
    torch.testing.assert_close(fv.agg_loss(loss_mat, mask, mode, **INFOS[info]), expected, atol=1e-6, rtol=1e-5)
    if INFOS[info].get("dp_size", 1) > 1 and mode != "token-sum":
        with pytest.raises(ValueError, match="required when dp_size > 1"):
            fv.agg_loss(loss_mat, mask, mode, dp_size=2)


# ------------------------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_verl(gamma, lam, seed):
    g = torch.Generator().manual_seed(100 + seed)
    mask = masks(seed)
    rewards = torch.where(torch.rand(B, T, generator=g) < 0.3, torch.randn(B, T, generator=g), 0.0)  # also off-mask
    values = torch.randn(B, T, generator=g)
    adv0, ret0 = core_algos.compute_gae_advantage_return(rewards, values, mask.float(), gamma, lam)
    adv1, ret1 = core_algos.get_adv_estimator_fn("fastpo_gae")(token_level_rewards=rewards, values=values,
                                                              response_mask=mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(ret1, ret0, atol=1e-5, rtol=1e-5)  # every position, off the mask included
    torch.testing.assert_close(adv1, adv0, atol=1e-5, rtol=1e-5)


def test_gae_reads_gamma_lam_from_config_and_refuses_empty_batches():
    g = torch.Generator().manual_seed(9)
    mask, rewards, values = masks(2), torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    cfg = types.SimpleNamespace(gamma=0.95, lam=0.9, get=lambda k, d=None: {"gamma": 0.95, "lam": 0.9}.get(k, d))
    adv0, _ = core_algos.compute_gae_advantage_return(rewards, values, mask.float(), 0.95, 0.9)
    adv1, _ = fv.compute_gae_advantage_fastpo(rewards, mask, values=values, config=cfg)
    torch.testing.assert_close(adv1, adv0, atol=1e-5, rtol=1e-5)
    empty = torch.zeros(B, T, dtype=torch.bool)
    with pytest.raises(ValueError):
        core_algos.compute_gae_advantage_return(rewards, values, empty.float(), 1.0, 1.0)
    with pytest.raises(ValueError, match="at least 2 trained tokens"):
        fv.compute_gae_advantage_fastpo(rewards, empty, values=values, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="patch_compute_advantage"):
        fv.compute_gae_advantage_fastpo(rewards, mask, gamma=1.0, lam=1.0)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_verl(norm, seed):
    g = torch.Generator().manual_seed(200 + seed)
    n = 13
    mask = torch.rand(n, T, generator=g) < 0.8
    mask[0] = False  # an empty response
    mask[1] = False
    mask[1, 4] = True  # a one-token response
    rewards = torch.zeros(n, T)
    rewards[:, -1] = torch.randint(0, 3, (n,), generator=g).float()  # ties: zero-std groups
    index = np.array(["a", "b", "a", "c", "b", "a", "d", "e", "e", "c", "b", "f", "e"], dtype=object)  # d, f: single
    adv0, ret0 = core_algos.compute_grpo_outcome_advantage(rewards, mask.float(), index,
                                                           norm_adv_by_std_in_grpo=norm)
    fn = core_algos.get_adv_estimator_fn("fastpo_grpo")
    adv1, ret1 = fn(token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv1, adv0, atol=1e-6, rtol=1e-5)
    cfg = types.SimpleNamespace(get=lambda k, d=None: {"norm_adv_by_std_in_grpo": norm}.get(k, d))
    adv2, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index, config=cfg)  # verl's dispatch
    torch.testing.assert_close(adv2, adv0, atol=1e-6, rtol=1e-5)


def test_bilevel_gae_and_gigpo_are_fastpo_kernels():
    g = torch.Generator().manual_seed(11)
    mask = masks(3)
    rewards = torch.where(mask & (torch.rand(B, T, generator=g) < 0.2), 1.0, 0.0)
    values = torch.randn(B, T, generator=g)
    adv, ret = core_algos.get_adv_estimator_fn("fastpo_bilevel_gae")(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=0.95, gamma_high=0.9)
    adv_k, ret_k = F.bilevel_gae_advantages(rewards, values, mask, torch.zeros_like(mask), 1.0, 0.95, 0.9,
                                            turns="reward")
    torch.testing.assert_close(adv, adv_k)
    torch.testing.assert_close(ret, ret_k)
    # GiGPO: two rows of one group, two turns each; the first turns share a state key
    turn_ids = torch.full((2, 6), -1)
    turn_ids[0, :3], turn_ids[0, 3:] = 0, 1
    turn_ids[1, :2], turn_ids[1, 2:5] = 0, 1
    response_mask = turn_ids >= 0
    scores = torch.zeros(2, 6)
    scores[0, -1], scores[1, -2] = 1.0, 0.0
    adv, _ = core_algos.get_adv_estimator_fn("fastpo_gigpo")(
        token_level_rewards=scores, response_mask=response_mask, index=np.array(["u", "u"], dtype=object),
        turn_ids=turn_ids, turn_keys=[[7, 8], [7, 9]], turn_rewards=[[0.0, 1.0], [0.0, 0.0]], step_weight=1.0,
        step_gamma=0.5)
    flat, _, sizes = F.gigpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([7, 8, 7, 9]),
                                        torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 2, 4]),
                                        torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, -1]),
                                        response_mask.reshape(-1), 1.0, 0.5)
    torch.testing.assert_close(adv.reshape(-1), flat)
    assert sizes.tolist() == [2, 1, 2, 1]


# ------------------------------------------------------------------------------------ routing, import
def test_compute_advantage_routing_hands_values_to_fastpo_estimators():
    from verl import DataProto

    g = torch.Generator().manual_seed(12)
    mask = masks(4)
    batch = {"token_level_rewards": torch.randn(B, T, generator=g), "values": torch.randn(B, T, generator=g),
             "response_mask": mask.float()}
    data = DataProto.from_dict(tensors=batch, non_tensors={"uid": np.array(list("aabbccd"), dtype=object)})
    calls = []

    def original(data, **kwargs):
        calls.append(kwargs["adv_estimator"])
        return data

    fake = types.ModuleType("fake_trainer")
    fake.compute_advantage = original
    assert fv.patch_compute_advantage([fake, "no.such.module"]) == ["fake_trainer"]
    assert fv.patch_compute_advantage([fake]) == ["fake_trainer"]  # idempotent
    fake.compute_advantage(data, adv_estimator="grpo")
    assert calls == ["grpo"]  # verl's own estimators go to verl's compute_advantage
    out = fake.compute_advantage(data, adv_estimator="fastpo_gae", gamma=0.99, lam=0.95)
    adv0, ret0 = core_algos.compute_gae_advantage_return(batch["token_level_rewards"], batch["values"],
                                                         mask.float(), 0.99, 0.95)
    torch.testing.assert_close(out.batch["advantages"], adv0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.batch["returns"], ret0, atol=1e-5, rtol=1e-5)
    assert calls == ["grpo"]


def test_import_error_without_verl(monkeypatch):
    for name in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "fastpo.integrations.verl", raising=False)
    with pytest.raises(ImportError, match="needs verl 0.9") as err:
        importlib.import_module("fastpo.integrations.verl")
    assert "\n" not in str(err.value)


def test_registration_is_idempotent():
    importlib.reload(fv)
    assert core_algos.get_adv_estimator_fn("fastpo_grpo") is fv.compute_grpo_advantage_fastpo
    assert core_algos.get_policy_loss_fn("fastpo_ppo") is fv.compute_policy_loss_fastpo
