"""Spare episodes in flight (``rollout.partial_spare``): the pool keeps more episodes in flight than the engine has
batch slots, the extra turns wait in the engine's queue, and the sampled tokens do not change; the config refuses
what cannot work before any model loads; the trainer sizes the engine and the envs for them."""

from __future__ import annotations

import numpy as np
import pytest
from test_partial_interrupt import tiny_agent_pool

from fastpo.config import ConfigError, RolloutConfig, config_hash
from fastpo.config_load import parse_args
from fastpo.engine import HFEngine
from fastpo.preflight import validate
from fastpo.rollout_pool import RolloutPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARTIAL = ["--rollout.mode", "async", "--rollout.partial", "true"]


@pytest.mark.parametrize("flags,message", [
    (["--rollout.partial_spare", "4"], r"rollout.partial_spare > 0 needs rollout.partial=true"),
    ([*PARTIAL, "--rollout.partial_spare", "-1"], r"rollout.partial_spare must lie in \[0, 4096\], got -1"),
    ([*PARTIAL, "--rollout.partial_spare", "4097"], r"rollout.partial_spare must lie in \[0, 4096\], got 4097"),
])
def test_spare_is_refused_where_it_cannot_work(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(["--preset", "tiny", *flags]), 1)


def test_spare_is_hashed_only_when_set():
    base = parse_args(["--preset", "tiny", *PARTIAL])
    assert config_hash(parse_args(["--preset", "tiny", *PARTIAL, "--rollout.partial_spare", "0"])) == config_hash(base)
    assert config_hash(parse_args(["--preset", "tiny", *PARTIAL, "--rollout.partial_spare", "3"])) != config_hash(base)


def test_spare_episodes_queue_for_the_slots_and_sample_the_same_tokens():
    """The tiny agent on FrozenLake and Sokoban, 4 calls of a pool of width 8 on an engine of 8 slots, then of width
    8 + 5 on the same 8 slots: the engine never holds more than 8 slots, turns of spare episodes wait in its queue,
    and every group both runs returned has the same tokens (a request's tokens depend on its seed and context only;
    the same weights are pushed between calls)."""
    tok, model, params, group, make_parts = tiny_agent_pool(seed=80, request_seed=9000, instances=30)
    runs = {}
    for spare in (0, 5):
        engine = HFEngine(model, tok, max_batch_size=8)
        seen = {"slots": 0, "queued": 0}
        step = engine.step

        def spy(step=step, engine=engine, seen=seen):
            seen["queued"] = max(seen["queued"], len(engine._running) + len(engine._waiting))
            out = step()
            seen["slots"] = max(seen["slots"], engine._pool.slots)
            return out

        engine.step = spy
        parts = make_parts()
        cfg = RolloutConfig(mode="async", partial=True, max_staleness=2, partial_kv="keep")
        pool = RolloutPool(parts, engine, tok, params, cfg, group, width=8 + spare)
        trajs = {}
        for call in range(4):
            batches, _ = pool.run(target=2, drain=call == 3)
            for t in (t for b in batches for t in b.trajectories):
                trajs.setdefault(t.group, []).append(t)
            engine.sync_weights(model, keep_cache=True)
        assert pool.in_flight() == 0 and engine.num_unfinished() == 0
        pool.close()
        runs[spare] = trajs, seen
    (plain, plain_seen), (spared, spared_seen) = runs[0], runs[5]
    assert plain_seen["slots"] <= 8 and spared_seen["slots"] <= 8
    assert plain_seen["queued"] <= 8 < spared_seen["queued"]  # spare turns waited in the engine's queue
    common = sorted(plain.keys() & spared.keys())
    assert len(common) >= 6
    for a, b in ((a, b) for g in common for a, b in zip(plain[g], spared[g], strict=True)):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_allclose(a.sample_logprobs, b.sample_logprobs, atol=1e-4, rtol=0)
