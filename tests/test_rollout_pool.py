"""Partial rollouts across iterations (``fastpo.rollout_pool``): with the weights unchanged between calls, every
group's trajectories equal the asynchronous driver's for the same seeds (episodes carried over continue with their
seeds); with the version moving on, no trained token lags by more than max_staleness; drain leaves
nothing in flight; bad groups are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fastpo.envs as E
from fastpo.config import RolloutConfig
from fastpo.engine import HFEngine, SamplingParams
from fastpo.model import load_policy, load_tokenizer, resolve_model_path
from fastpo.prompts import prompt_spec
from fastpo.rollout import RolloutPart, run_rollouts
from fastpo.rollout_pool import NewGroup, PoolStats, RolloutPool

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("</answer>",))
ENVS = (("frozenlake", {"is_slippery": False}), ("sokoban", {}))
SIZE = 3


@pytest.fixture(scope="module")
def agent():
    torch.set_num_threads(1)
    path = resolve_model_path("tiny")
    return load_tokenizer(path), load_policy(path).eval()


def group(n: int) -> NewGroup:
    """The n-th group: parts alternate; env seed, group id and request seeds are functions of n."""
    return NewGroup(part=n % 2, seed=50 + n, group=n, request_seeds=tuple(7000 + SIZE * n + j for j in range(SIZE)))


def pool_parts(capacity: int) -> list[RolloutPart]:
    return [RolloutPart(E.make(name, capacity, **kw), prompt_spec(name, enable_think=False), [0] * capacity,
                        [0] * capacity, max_turns=4, max_actions_per_turn=2) for name, kw in ENVS]


def reference(groups: list[NewGroup], tok, model) -> dict[int, list]:
    """The same groups in one asynchronous rollout: group id -> its trajectories."""
    parts = []
    for k, (name, kw) in enumerate(ENVS):
        mine = [g for g in groups if g.part == k]
        n = len(mine) * SIZE
        parts.append(RolloutPart(E.make(name, n, **kw), prompt_spec(name, enable_think=False),
                                 np.repeat([g.seed for g in mine], SIZE), np.repeat([g.group for g in mine], SIZE),
                                 [s for g in mine for s in g.request_seeds], max_turns=4, max_actions_per_turn=2))
    batches = run_rollouts(parts, HFEngine(model, tok), tok, PARAMS, RolloutConfig(mode="async"))
    out: dict[int, list] = {}
    for b in batches:
        for t in b.trajectories:
            out.setdefault(t.group, []).append(t)
    return out


@pytest.mark.slow
def test_unchanged_weights_give_the_async_trajectories(agent):
    tok, model = agent
    engine = HFEngine(model, tok)
    cfg = RolloutConfig(mode="async", partial=True, max_staleness=2)
    pool = RolloutPool(pool_parts(4 * 2 * SIZE), engine, tok, PARAMS, cfg, group, width=4 * SIZE)
    got, stats = {}, []
    for call in range(4):
        batches, st = pool.run(target=4, drain=call == 3)
        stats.append(st)
        for b in batches:
            for t in b.trajectories:
                got.setdefault(t.group, []).append(t)
        engine.sync_weights(model)  # the same weights: a new version
    assert pool.in_flight() == 0 and engine.num_unfinished() == 0
    assert sum(s.tail_turns for s in stats) > 0 and max(s.carried for s in stats[:-1]) > 0  # really partial
    assert all(s.finished >= 4 for s in stats)
    # each call's forward seconds add up to the engine's; logged per rank as the mean over ranks
    assert sum(s.engine.prefill_s for s in stats) == pytest.approx(engine.stats.prefill_s)
    assert sum(s.engine.decode_s for s in stats) == pytest.approx(engine.stats.decode_s)
    assert all(s.engine.prefill_s > 0 and s.engine.decode_s > 0 for s in stats)
    logged = PoolStats.combined(stats[:2])
    assert logged["rollout/prefill_s"] == pytest.approx((stats[0].engine.prefill_s + stats[1].engine.prefill_s) / 2)
    assert sorted(got) == list(range(pool.next_group))  # every started group came back once
    want = reference([group(n) for n in range(pool.next_group)], tok, model)
    spans = 0
    for gid, trajs in got.items():
        for a, b in zip(trajs, want[gid], strict=True):
            for f in dataclasses.fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if f.name == "versions":
                    spans += len(set(x[x >= 0].tolist())) > 1
                elif f.name == "sample_logprobs":
                    np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)
                elif isinstance(x, np.ndarray):
                    np.testing.assert_array_equal(x, y, err_msg=f.name)
                else:
                    assert x == y, f.name
    assert spans > 0  # some episodes were sampled under two versions
    pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [1, 2])
def test_no_trained_token_is_staler_than_the_bound(agent, staleness):
    tok, model = agent
    engine = HFEngine(model, tok)
    cfg = RolloutConfig(mode="async", partial=True, max_staleness=staleness)
    pool = RolloutPool(pool_parts(4 * 2 * SIZE), engine, tok, PARAMS, cfg, group, width=4 * SIZE)
    lags = []
    for call in range(5):
        version = engine.weight_version
        batches, st = pool.run(target=3, drain=call == 4)
        if call < 4:  # one iteration's worth, more only for groups at the bound
            assert st.finished == max(3, st.forced) == sum(len(b.trajectories) for b in batches) // SIZE
        for t in (t for b in batches for t in b.trajectories):
            v = t.versions[t.versions >= 0]
            assert v.size and v.max() <= version and version - v.min() <= staleness
            assert np.all(t.versions[t.loss_mask] >= 0)  # every trained token has its version
            lags.append(int(version - v.min()))
        engine.sync_weights(model)
    assert max(lags) >= 1 and pool.in_flight() == 0
    pool.close()


@pytest.mark.parametrize("calls", [1, 2])
def test_a_drain_returns_at_least_one_iterations_worth(agent, calls):
    """A drain (a checkpoint step or the last step) on a fresh pool (a 1-iteration run) or right after a drain
    starts and finishes one iteration's worth of groups; it used to return nothing, as nothing was in flight."""
    tok, model = agent
    engine = HFEngine(model, tok)
    cfg = RolloutConfig(mode="async", partial=True, max_staleness=1)
    pool = RolloutPool(pool_parts(4 * 2 * SIZE), engine, tok, PARAMS, cfg, group, width=4 * SIZE)
    seen = []
    for _ in range(calls):
        batches, st = pool.run(target=3, drain=True)
        assert st.finished >= 3 and sum(len(b.trajectories) for b in batches) == SIZE * st.finished
        assert pool.in_flight() == 0 and not pool.held
        seen += [t.group for b in batches for t in b.trajectories]
        engine.sync_weights(model)
    assert sorted(set(seen)) == list(range(pool.next_group))
    pool.close()


def test_bad_groups_are_refused(agent):
    tok, model = agent
    cfg = RolloutConfig(mode="async", partial=True)
    with pytest.raises(ValueError, match="width"):
        RolloutPool(pool_parts(6), HFEngine(model, tok), tok, PARAMS, cfg, group, width=SIZE - 1).run(1)
    with pytest.raises(ValueError, match="part must lie"):
        RolloutPool(pool_parts(6), HFEngine(model, tok), tok, PARAMS, cfg,
                    lambda n: dataclasses.replace(group(n), part=5), width=6).run(1)
    with pytest.raises(ValueError, match="still in the pool"):
        RolloutPool(pool_parts(12), HFEngine(model, tok), tok, PARAMS, cfg,
                    lambda n: dataclasses.replace(group(n), part=0, group=0), width=12).run(2)
    with pytest.raises(ValueError, match="target"):
        RolloutPool(pool_parts(6), HFEngine(model, tok), tok, PARAMS, cfg, group, width=6).run(0)


def test_env_failure_fails_the_call_and_close_leaves_nothing(agent):
    """An env that raises in the middle of a call: the error comes out as the env raised it, no request stays in
    flight, and closing the pool closes every session (the trainer then stops the run; checkpoints stay valid)."""
    tok, model = agent
    engine = HFEngine(model, tok)
    cfg = RolloutConfig(mode="async", partial=True)
    pool = RolloutPool(pool_parts(4 * 2 * SIZE), engine, tok, PARAMS, cfg, group, width=4 * SIZE)
    pool.run(target=2)  # a first call carries episodes over
    env = pool.runs[1].env
    real_step, calls = env.step, []

    def step(actions, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Sokoban.step failed for seed 53")
        return real_step(actions, *args, **kwargs)

    env.step = step
    with pytest.raises(RuntimeError, match="Sokoban.step failed for seed 53"):
        pool.run(target=2)
    assert engine.num_unfinished() == 0
    pool.close()
    assert not engine._sessions


def test_combined_sums_the_engine_counters_and_averages_the_seconds():
    from fastpo.engine.base import EngineStats

    a = EngineStats(decode_steps=4, row_steps=8, slot_steps=16, tokens=10, first_tokens=2, prefill_tokens=30,
                    prefill_positions=40, prefill_s=1.0, decode_s=3.0)
    b = EngineStats(decode_steps=2, row_steps=4, slot_steps=4, tokens=5, first_tokens=1, prefill_tokens=6,
                    prefill_positions=6, prefill_s=0.5, decode_s=1.0)
    assert a.plus(b).since(b) == a and a.plus(b).useful_tokens() == 12
    out = PoolStats.combined([PoolStats(started=1, carried=2, engine=a), PoolStats(started=3, engine=b)])
    assert out["rollout/partial_started"] == 4.0 and out["rollout/partial_carried"] == 2.0
    assert out["rollout/partial_prefill_tokens"] == 36.0
    assert out["rollout/decode_occupancy"] == 12 / 12 and out["rollout/slot_occupancy"] == 12 / 20
    assert out["rollout/prefill_s"] == 0.75 and out["rollout/decode_s"] == 2.0
    assert "rollout/slot_occupancy" not in PoolStats.combined([PoolStats()])
