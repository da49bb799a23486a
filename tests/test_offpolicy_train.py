"""algorithm.offpolicy_correction in the trainer: the config checks, and in-process iterations on the tiny preset
shrunk as in test_old_logprobs.py (8 kept trajectories in mini-batches of 4: 2 optimiser steps, so the old
logprobs come from the trainer's scoring pass; ``ON_POLICY`` makes it one step whose own forward gives them).

The tiny agent samples and scores in fp32 with the same kernels, so its sampler / trainer gap is ~1e-7: the
correction is almost neutral there. The tests that need a real mismatch shift the sampler's logprobs after the
rollout (``_shift_sample_logprobs``), with the gap guard opened so that it does not stop the run."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_trainer import _main_ok, _metrics, train_iterations

from fastpo import algorithms
from fastpo.config import AlgorithmConfig, ConfigError, config_hash
from fastpo.config_load import parse_args
from fastpo.preflight import validate
from fastpo.trainer import Trainer

SMALL = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.val_groups", "4",
         "--env.env_groups", "4", "--env.group_size", "4", "--optim.mini_batch_size", "4",
         "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.iterations", "1",
         "--trainer.val_before_train", "false", "--trainer.val_every", "0", "--algorithm.old_logprobs", "trainer"]
ON_POLICY = ["--optim.mini_batch_size", "8"]
IS_METRICS = ("actor/is_ratio_mean", "actor/is_ratio_max", "actor/is_ratio_min", "actor/is_clipped_frac",
              "actor/is_masked_seq_frac", "actor/is_masked_token_frac")


# ---------------------------------------------------------------------------------------------- config
def _errors(*args: str) -> str:
    with pytest.raises(ConfigError) as exc:
        validate(parse_args([*SMALL, *args]), 1)
    return str(exc.value)


@pytest.mark.parametrize("args,needle", [
    (("--algorithm.is_cap", "1.0"), "algorithm.is_cap must be > 1 (inf disables the truncation), got 1.0"),
    (("--algorithm.is_mask_low", "1.0"), "algorithm.is_mask_low must lie in [0, 1), got 1.0"),
    (("--algorithm.is_mask_low", "-0.5"), "algorithm.is_mask_low must lie in [0, 1), got -0.5"),
    (("--algorithm.is_mask_high", "0.9"), "algorithm.is_mask_high must be > 1 (inf disables the bound), got 0.9"),
    (("--algorithm.offpolicy_correction", "tis", "--algorithm.old_logprobs", "engine"),
     "algorithm.offpolicy_correction=tis needs algorithm.old_logprobs=trainer"),
    (("--algorithm.offpolicy_correction", "mis", "--rollout.train_on_observations", "true"),
     "algorithm.offpolicy_correction=mis needs rollout.train_on_observations=false"),
    (("--algorithm.offpolicy_correction", "decoupled", "--rollout.canonical", "true"),
     "algorithm.offpolicy_correction=decoupled needs rollout.canonical=false"),
    (("--algorithm.offpolicy_correction", "sis"), "algorithm.offpolicy_correction"),
])
def test_config_refuses_bad_settings(args, needle):
    assert needle in _errors(*args)


def test_config_accepts_inf_and_hashes_the_new_fields():
    cfg = validate(parse_args([*SMALL, "--algorithm.offpolicy_correction", "mis", "--algorithm.is_cap", "inf",
                               "--algorithm.is_mask_low", "0", "--algorithm.is_mask_high", "inf"]), 1)
    assert math.isinf(cfg.algorithm.is_cap) and math.isinf(cfg.algorithm.is_mask_high)
    with pytest.raises(ConfigError, match="algorithm.is_mask_low must be a finite number"):
        validate(parse_args([*SMALL, "--algorithm.is_mask_low", "inf"]), 1)
    # they change the update's math: a resume across a change of them is refused
    base = validate(parse_args(SMALL), 1)
    on = validate(parse_args([*SMALL, "--algorithm.offpolicy_correction", "tis"]), 1)
    on_moved = validate(parse_args([*SMALL, "--algorithm.offpolicy_correction", "tis", "--algorithm.is_cap", "5"]), 1)
    assert len({config_hash(base), config_hash(on), config_hash(on_moved)}) == 3


def test_algorithms_weights_and_the_registry_call():
    """Off: no weight and the registered loss is called without ``is_weight``; on: weights and actor/is_* metrics,
    and the loss equals ppo_loss with that is_weight."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    sample = old - torch.tensor([0.0, 1.0, -0.2, 0.1, 5.0])
    mask, cu = torch.tensor([True, True, True, False, True]), torch.tensor([0, 3, 5])
    assert algorithms.offpolicy_weights(old, sample, mask, AlgorithmConfig(), cu_seqlens=cu) == (None, {})
    cfg = AlgorithmConfig(offpolicy_correction="tis", is_cap=2.0)
    w, m = algorithms.offpolicy_weights(old, sample, mask, cfg, cu_seqlens=cu)
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, math.exp(-0.2), 1.0, 2.0]))
    assert set(m) == set(IS_METRICS) and m["actor/is_clipped_frac"].item() == 0.5
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3])
    loss, metrics = algorithms.policy_loss(logp, old, adv, mask, None, None, cfg, cu_seqlens=cu, is_weight=w)
    want, _ = algorithms.kernels.ppo_loss(logp, old, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                          clip_c=cfg.clip_c, cu_seqlens=cu, is_weight=w)
    assert torch.equal(loss, want) and metrics["actor/pg_loss"] == want.detach()
    plain, _ = algorithms.policy_loss(logp, old, adv, mask, None, None, cfg, cu_seqlens=cu)
    assert plain.item() != loss.item()


# ------------------------------------------------------------------------------------------- training
def _shift_sample_logprobs(monkeypatch, shift: float):
    """Every trained token's sampler logprob moves by ``shift``: the ratio pi_old / pi_sampler becomes ~exp(-shift)."""
    rollout = Trainer._rollout

    def shifted(self, *args, **kwargs):
        trajs, metrics = rollout(self, *args, **kwargs)
        for t in trajs:
            t.sample_logprobs = np.where(t.loss_mask, t.sample_logprobs + shift, t.sample_logprobs).astype(np.float32)
        return trajs, metrics

    monkeypatch.setattr(Trainer, "_rollout", shifted)


def _iteration(tmp_path, run: str, *extra: str):
    """One iteration: (its metrics, the actor's weights after it)."""
    rows, weights = train_iterations(
        validate(parse_args([*SMALL, *extra, "--trainer.run_dir", str(tmp_path / run)]), 1))
    return rows[0], weights


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [[], ON_POLICY], ids=["scored", "on_policy"])
def test_neutral_settings_train_like_no_correction(tmp_path, policy):
    """mis with bounds [0, inf) gives weights of exactly 1: the update is the uncorrected one bit for bit. tis
    with cap inf weighs by the true ratio, ~1 +- 1e-6 here: the same update up to that."""
    m_ref, w_ref = _iteration(tmp_path, "ref", *policy)
    m_mis, w_mis = _iteration(tmp_path, "mis", *policy, "--algorithm.offpolicy_correction", "mis",
                              "--algorithm.is_mask_low", "0", "--algorithm.is_mask_high", "inf")
    m_tis, w_tis = _iteration(tmp_path, "tis", *policy, "--algorithm.offpolicy_correction", "tis",
                              "--algorithm.is_cap", "inf")
    assert m_ref["rollout/kept_trajectories"] == 8
    assert _same(w_mis, w_ref)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert m_mis[key] == m_ref[key], key
        assert m_tis[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    for m in (m_mis, m_tis):
        assert all(math.isfinite(m[k]) for k in IS_METRICS), {k: m[k] for k in IS_METRICS}
        assert m["actor/is_masked_seq_frac"] == 0.0 and m["actor/is_clipped_frac"] == 0.0
        assert m["actor/is_ratio_min"] <= m["actor/is_ratio_mean"] <= m["actor/is_ratio_max"]
        assert abs(m["actor/is_ratio_max"] - 1) < 1e-4 and abs(m["actor/is_ratio_min"] - 1) < 1e-4
    assert not any(k.startswith("actor/is_") for k in m_ref)
    # Adam's first steps are ~lr * sign(grad): a ~1e-6 change of a ~0 gradient element can move its step
    for k in w_ref:
        torch.testing.assert_close(w_tis[k], w_ref[k], atol=3e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [[], ON_POLICY], ids=["scored", "on_policy"])
def test_a_real_mismatch_is_corrected(tmp_path, monkeypatch, policy):
    """Sampler logprobs 1 nat above the trainer's: ratio exp(-1) = 0.37 on every token. mis [0.5, 2] masks every
    trajectory (no policy gradient: only the entropy bonus moves the weights); tis keeps the ratio (below the
    cap). Then 1 nat below: ratio e = 2.72, truncated at 2 by tis, dropped by decoupled."""
    open_guard = ["--trainer.logprob_gap_max", "inf"]
    m_ref, w_ref = _iteration(tmp_path, "ref", *policy, *open_guard)
    _shift_sample_logprobs(monkeypatch, 1.0)
    m_mis, w_mis = _iteration(tmp_path, "mis", *policy, *open_guard, "--algorithm.offpolicy_correction", "mis")
    m_tis, _ = _iteration(tmp_path, "tis", *policy, *open_guard, "--algorithm.offpolicy_correction", "tis")
    assert m_mis["actor/is_masked_seq_frac"] == pytest.approx(1.0)
    assert m_mis["actor/is_masked_token_frac"] == pytest.approx(1.0)
    assert m_mis["actor/is_ratio_mean"] == pytest.approx(math.exp(-1), rel=1e-4)
    assert m_tis["actor/is_ratio_mean"] == pytest.approx(math.exp(-1), rel=1e-4)
    assert m_tis["actor/is_clipped_frac"] == 0.0
    assert not _same(w_mis, w_ref)
    # the pg term is gone: only the entropy bonus (coefficient 0.001) remains, a much smaller gradient
    assert m_mis["actor/grad_norm"] < 0.1 * m_ref["actor/grad_norm"]
    _shift_sample_logprobs(monkeypatch, -2.0)  # on top of the +1: -1 in all
    m_tis, w_tis = _iteration(tmp_path, "tis2", *policy, *open_guard, "--algorithm.offpolicy_correction", "tis")
    m_dec, _ = _iteration(tmp_path, "dec", *policy, *open_guard, "--algorithm.offpolicy_correction", "decoupled")
    for m in (m_tis, m_dec):
        assert m["actor/is_ratio_mean"] == pytest.approx(math.e, rel=1e-4)
        assert m["actor/is_clipped_frac"] == pytest.approx(1.0)
        assert all(math.isfinite(m[k]) for k in IS_METRICS)
    assert m_tis["actor/is_masked_token_frac"] == 0.0 and m_dec["actor/is_masked_token_frac"] == pytest.approx(1.0)
    assert m_dec["actor/grad_norm"] < 0.1 * m_ref["actor/grad_norm"]
    assert not _same(w_tis, w_ref)  # weight 2 on every token: twice the clipped term's gradient


def _train(run_dir, nproc: int, *extra: str) -> dict:
    """fastpo.train in a subprocess (torchrun for nproc > 1); returns its one metrics row."""
    launcher = [sys.executable, "-m", "fastpo.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
        "fastpo.train"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    # cwd outside the checkout: there ./kernels would be imported as the top-level HF `kernels` package
    out = subprocess.run([*launcher, *SMALL, *extra, "--trainer.run_dir", str(run_dir)], cwd=run_dir.parent, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_two_ranks_reduce_the_statistics_like_one(tmp_path, capsys):
    """On 2 FSDP2 ranks the ratio extremes are reduced across ranks (a collective in the actor update: no rank may
    skip it) and the means accumulate like the other actor metrics: the 1-rank figures within float noise."""
    args = ("--algorithm.offpolicy_correction", "tis")
    _main_ok([*SMALL, *args], tmp_path / "one", capsys)  # in this process; the 2 ranks under torchrun
    one, two = _metrics(tmp_path / "one")[0], _train(tmp_path / "two", 2, *args)
    for key in (*IS_METRICS, "actor/pg_loss", "actor/grad_norm"):
        assert one[key] is not None and math.isfinite(two[key]), key
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
