"""The trainer with partial rollouts (``rollout.partial``) and with dynamic sampling (``algorithm.refill_rounds``):
config errors before any model loads, exact resume across a checkpoint (checkpoint steps drain the pool), the
staleness bound in the logged metrics, refill rounds and their bounds, and the asynchronous driver on 1 vs 2 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_trainer import GAE, SMALL, _main_ok, _metrics, _ok, _weights

from fastpo.config import ConfigError
from fastpo.config_load import parse_args
from fastpo.preflight import validate
from fastpo.presets import get_preset

PARTIAL = ["--rollout.mode", "async", "--rollout.partial", "true", "--algorithm.offpolicy_correction", "tis",
           "--algorithm.old_logprobs", "trainer"]


@pytest.mark.parametrize("field,value,message", [
    ("max_staleness", 0, r"rollout.max_staleness must lie in \[1, 8\], got 0"),
    ("max_staleness", 9, r"rollout.max_staleness must lie in \[1, 8\], got 9"),
    ("refill_rounds", -1, r"algorithm.refill_rounds must lie in \[0, 16\], got -1"),
    ("refill_rounds", 17, r"algorithm.refill_rounds must lie in \[0, 16\], got 17"),
    ("partial_lockstep", True, "rollout.partial=true needs rollout.mode=async"),
    ("partial_refill", 2, "rollout.partial=true cannot be combined with algorithm.refill_rounds=2"),
])
def test_out_of_range_is_one_config_error(field, value, message):
    cfg = get_preset("tiny")
    if field == "max_staleness":
        cfg.rollout.max_staleness = value
    elif field == "refill_rounds":
        cfg.algorithm.refill_rounds = value
    elif field == "partial_lockstep":
        cfg.rollout.partial = value
    else:
        cfg.rollout.partial, cfg.rollout.mode, cfg.algorithm.refill_rounds = True, "async", value
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


@pytest.mark.slow
# the cut-turn case also keeps a spare episode queued for the engine's slots (rollout.partial_spare): one run
# covers both (each alone doubles the suite's slowest test)
@pytest.mark.parametrize("partial_kv,cut,spare", [("recompute", False, 0), ("keep", False, 0), ("keep", True, 1)])
def test_partial_rollouts_resume_exactly_and_respect_the_bound(tmp_path, capsys, partial_kv, cut, spare):
    """4 iterations straight == 2 + checkpoint + resume to 4 in a new process, bit for bit, with partial rollouts
    (the checkpoint step drains the pool, so the checkpoint holds no episode in flight), whether the weight push
    drops the carried episodes' KV caches or keeps them (rollout.partial_kv), and whether the turns in flight at an
    iteration's end finish or are cut (rollout.partial_interrupt), and with spare episodes queued for the
    engine's slots (rollout.partial_spare). The logged staleness never exceeds max_staleness, and episodes really
    were carried across iterations."""
    args = [*SMALL, *GAE, *PARTIAL, "--trainer.deterministic", "true", "--trainer.save_every", "2",
            "--rollout.partial_kv", partial_kv, "--rollout.partial_interrupt", str(cut).lower(),
            "--rollout.partial_spare", str(spare)]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # fastpo.train's main in this process, a new Trainer per launch (test_trainer covers resume across processes)
    _main_ok([*args, "--trainer.iterations", "4"], straight, capsys)
    _main_ok([*args, "--trainer.iterations", "2"], split, capsys)
    out = _main_ok([*args, "--trainer.iterations", "4"], split, capsys)
    assert "resumed from step 2" in out
    a, b = _metrics(straight), _metrics(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    keys = [k for k in a[0] if k.startswith(("actor/", "critic/", "rollout/reward", "rollout/partial_"))]
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    wa, wb = _weights(straight / "hf"), _weights(split / "hf")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a[0]["rollout/partial_carried"] > 0 and a[1]["rollout/partial_carried"] == 0  # step 2 drained
    assert (a[0]["rollout/partial_interrupted"] > 0) == cut and a[1]["rollout/partial_interrupted"] == 0
    assert max(r["rollout/staleness_max"] for r in a) == 1 and all(r["rollout/staleness_max"] <= 1 for r in a)
    stale = [r for r in a if r["rollout/staleness_max"] == 1]
    assert all(r["rollout/stale_token_share"] > 0 and r["actor/is_ratio_min"] < 1 for r in stale)  # TIS saw them


@pytest.mark.slow
def test_refill_rounds_top_up_the_filtered_batch(tmp_path):
    """Dynamic sampling on the shrunk tiny preset with the nonzero filter: rounds of new groups join until the
    target number of groups with a reward spread is reached (or the round limit); the filter keeps exactly the
    target when it is reached, the env seed counter moves by one env_groups per round, and each round samples with
    its own seeds."""
    from fastpo.trainer import Trainer

    base = [*SMALL, "--trainer.val_before_train", "false", "--trainer.val_every", "0", "--trainer.save_every", "0",
            "--algorithm.rollout_filter_type", "nonzero", "--algorithm.rollout_filter_ratio", "1.0",
            "--optim.mini_batch_size", "4"]
    rows = {}
    for rounds in (0, 3):
        cfg = validate(parse_args([*base, "--algorithm.refill_rounds", str(rounds),
                                   "--trainer.run_dir", str(tmp_path / f"r{rounds}")]), 1)
        trainer = Trainer(cfg)
        try:
            trainer.step = 1
            seed0 = trainer.train_seed
            m = trainer.iteration()
            rows[rounds] = (m, trainer.train_seed - seed0)
        finally:
            trainer.close(export=False)
    plain, (refilled, moved) = rows[0][0], rows[3]
    assert "rollout/refill_rounds" not in plain and rows[0][1] == 4
    used = int(refilled["rollout/refill_rounds"])
    assert 0 <= used <= 3 and moved == 4 * (used + 1)
    spread_first = plain["rollout/kept_trajectories"] / 4  # groups with a spread in round 0 (nonzero keeps them)
    if spread_first < 4:
        assert used >= 1  # round 0 alone fell short of the 4-group target
    kept_groups = refilled["rollout/kept_trajectories"] / 4
    assert kept_groups <= 4 and kept_groups >= spread_first
    if used < 3:
        assert kept_groups == 4  # stopped early: the target was reached, and the filter kept exactly it


@pytest.mark.slow
def test_async_rollout_one_rank_equals_two_ranks(tmp_path, capsys):
    """The asynchronous driver on 1 process and on 2 torchrun ranks (each rank its own groups and engine): the same
    trajectories (rewards, lengths) and the same first update within the float noise of the 2-rank reduction."""
    args = [*SMALL, *GAE, "--trainer.iterations", "1", "--rollout.mode", "async"]
    _main_ok(args, tmp_path / "one", capsys)  # in this process; the 2 ranks under torchrun
    _ok(args, tmp_path / "two", nproc=2)
    a, b = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    # per-trajectory means and whole-batch sums (a per-turn mean such as response_length is combined over ranks
    # as a mean of rank means, so it differs with the split)
    for key in ("rollout/reward", "rollout/num_turns", "rollout/success", "perf/trained_seq_tokens",
                "perf/rollout_tokens"):
        assert a[key] == b[key], key
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    wa, wb = _weights(tmp_path / "one" / "hf"), _weights(tmp_path / "two" / "hf")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-4, rtol=0)
    assert np.isfinite(a["rollout/decode_occupancy"]) and np.isfinite(b["rollout/decode_occupancy"])
