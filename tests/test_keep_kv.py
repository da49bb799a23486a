"""In-flight weight updates (``rollout.partial_kv keep``): ``HFEngine.sync_weights(keep_cache=True)`` keeps the open
sessions' KV caches across a weight push. With the same weights keep and recompute continue a session exactly as
without a push; with new weights keep's next turn is the old cache + the new weights (checked against a hand-built
transformers cache), and it prefills only the new tokens. The config refuses keep where it cannot work, the pool
keeps its carried episodes' caches, and the parity guard leaves out turns with an older context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import fastpo.envs as E
from fastpo import update
from fastpo.config import ConfigError, RolloutConfig
from fastpo.config_load import parse_args
from fastpo.engine import HFEngine, SamplingParams
from fastpo.model import load_policy, load_tokenizer, resolve_model_path
from fastpo.preflight import validate
from fastpo.prompts import prompt_spec
from fastpo.rollout import RolloutPart
from fastpo.rollout_pool import NewGroup, RolloutPool
from fastpo.testing import clone_model
from fastpo.trajectory import Trajectory

ATOL = 1e-5
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(two_tiny_models):
    """(tokenizer, model, other model) (conftest's ``two_tiny_models``)."""
    return two_tiny_models


def _prompts(n: int, vocab: int, lengths=(17, 9, 23)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


OBS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _two_turns(model, tok, push=None, keep=False):
    """Turn 1 (seeds 0..), an optional push, the observations, turn 2 (seeds 10..) on 3 sessions of an engine that
    owns a copy of `model`. Returns (engine, sids, turn-2 results, prefill tokens of turn 2)."""
    engine = HFEngine(clone_model(model), tok)
    sids = engine.open_sessions(3)
    engine.extend(sids, _prompts(3, len(tok)))
    engine.generate_sessions(sids, PARAMS, [0, 1, 2])
    if push is not None:
        assert engine.sync_weights(push, keep_cache=keep) == 1
    engine.extend(sids, OBS)
    before = engine.stats.prefill_tokens
    results = engine.generate_sessions(sids, PARAMS, [10, 11, 12])
    return engine, sids, results, engine.stats.prefill_tokens - before


def test_same_weights_keep_and_recompute_continue_as_without_a_push(tiny):
    tok, old, _ = tiny
    _, _, plain, _ = _two_turns(old, tok)
    for keep in (True, False):
        _, _, got, _ = _two_turns(old, tok, push=old.state_dict(), keep=keep)
        for a, b in zip(got, plain, strict=True):
            assert a.token_ids == b.token_ids and a.weight_version == 1 and b.weight_version == 0
            if keep:  # the very same forwards as without the push
                assert a.logprobs == b.logprobs
            else:  # one prefill of the whole context instead of two: float differences only
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL, rtol=0)


def test_keep_prefills_only_the_new_tokens(tiny):
    """(d) after a keep push a carried session prefills its last sampled token and its observation, nothing of its
    older context; after a recompute push, its whole context."""
    tok, old, new = tiny
    engine, sids, _, kept = _two_turns(old, tok, push=new.state_dict(), keep=True)
    assert kept == sum(1 + len(o) for o in OBS)
    engine, sids, results, recomputed = _two_turns(old, tok, push=new.state_dict(), keep=False)
    contexts = [len(engine.session_token_ids(s)) - len(r.token_ids) for s, r in zip(sids, results, strict=True)]
    assert recomputed == sum(contexts)


def test_new_weights_keep_is_the_old_cache_under_the_new_weights(tiny):
    """Keep and recompute differ once the weights do; keep's turn-2 logprobs equal a hand computation: the context
    before the push run through the OLD model into a transformers cache, then the rest (the last turn-1 token, the
    observation and turn 2's own tokens) through the NEW model on top of that cache."""
    tok, old, new = tiny
    _, _, recompute, _ = _two_turns(old, tok, push=new.state_dict(), keep=False)
    engine, sids, keep, _ = _two_turns(old, tok, push=new.state_dict(), keep=True)
    assert any(a.token_ids != b.token_ids or not np.allclose(a.logprobs, b.logprobs, atol=1e-3)
               for a, b in zip(keep, recompute, strict=True))
    for sid, obs, result in zip(sids, OBS, keep, strict=True):
        ids = engine.session_token_ids(sid)
        n = len(result.token_ids)
        cached = len(ids) - n - len(obs) - 1  # in the cache at the push: all but the last turn-1 token
        with torch.no_grad():
            cache = DynamicCache()
            old(torch.tensor([ids[:cached]]), past_key_values=cache, use_cache=True)
            logits = new(torch.tensor([ids[cached:-1]]), past_key_values=cache, use_cache=True).logits[0].float()
        logp = torch.log_softmax(logits[-n:], dim=-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs), logp, atol=ATOL, rtol=0)
        assert result.weight_version == 1


def test_keep_is_still_refused_while_requests_are_in_flight(tiny):
    tok, old, _ = tiny
    engine = HFEngine(clone_model(old), tok)
    sid = engine.open_sessions(1)
    engine.extend(sid, _prompts(1, len(tok)))
    engine.submit(sid[0], PARAMS, 0)
    engine.step()
    with pytest.raises(RuntimeError, match=r"sync_weights with 1 request\(s\) in flight"):
        engine.sync_weights(old.state_dict(), keep_cache=True)
    assert engine.weight_version == 0


PARTIAL = ["--rollout.mode", "async", "--rollout.partial", "true", "--rollout.partial_kv", "keep"]


@pytest.mark.parametrize("flags,message", [
    (["--rollout.partial_kv", "keep"], "rollout.partial_kv=keep needs rollout.partial=true"),
    ([*PARTIAL, "--rollout.engine", "vllm"], "rollout.partial_kv=keep needs rollout.engine=hf, got vllm"),
    ([*PARTIAL, "--rollout.max_context_window", "2"],
     r"rollout.partial_kv=keep needs a context that grows turn by turn .*got full, 2, False"),
    ([*PARTIAL, "--rollout.canonical", "true"],
     r"rollout.partial_kv=keep needs a context that grows turn by turn .*got full, -1, True"),
])
def test_keep_is_refused_where_it_cannot_work(flags, message):
    """The flags as a user types them (the command-line loader), refused by the config check before any model."""
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(["--preset", "tiny", *flags]), 1)


def test_partial_kv_bad_value_is_one_line():
    lines = RolloutConfig(partial_kv="reuse").check()
    assert lines == ["rollout.partial_kv must be one of recompute, keep, got 'reuse'"]
    assert RolloutConfig(partial=True, mode="async", partial_kv="keep").check() == []


def test_guard_leaves_out_turns_whose_context_is_older():
    """Under keep, a token sampled at the current version in an episode that started earlier attended to keys /
    values of older weights: the parity guard compares only episodes sampled wholly at the current version."""
    def traj(versions, gap):
        v = np.array(versions, dtype=np.int32)
        return Trajectory(input_ids=np.zeros(len(v)), loss_mask=v >= 0, sample_logprobs=np.full(len(v), -1.0),
                          old_logp=np.full(len(v), -1.0 - gap), versions=v)

    carried, fresh = traj([-1, 3, 3, -1, 4, 4], 0.5), traj([-1, 4, 4, -1, 4], 0.01)
    both = update.logprob_gap([carried, fresh], [0, 1], False, version=4)
    assert both["rollout/logprob_gap_max"] == pytest.approx(0.5)
    keep = update.logprob_gap([carried, fresh], [0, 1], False, version=4, whole_context=True)
    assert keep["rollout/logprob_gap_max"] == pytest.approx(0.01)
    assert update.logprob_gap([carried], [0], False, version=4, whole_context=True) == {}


@pytest.mark.slow
def test_pool_keeps_the_carried_caches(tmp_path):
    """A partial-rollout pool on the tiny agent, a push of the same weights between calls: keep and recompute
    return the same trajectories; under keep the carried episodes' sessions keep their cached columns across the
    push and resume prefilling after them, so the calls after the first prefill fewer tokens."""
    torch.set_num_threads(1)
    path = resolve_model_path("tiny")
    tok, model = load_tokenizer(path), load_policy(path).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("</answer>",))

    def group(n: int) -> NewGroup:  # parts alternate (test_rollout_pool's schedule)
        return NewGroup(part=n % 2, seed=50 + n, group=n, request_seeds=tuple(7000 + 3 * n + j for j in range(3)))

    runs = {}
    for mode in ("recompute", "keep"):
        engine = HFEngine(model, tok)
        parts = [RolloutPart(E.make(name, 24, **kw), prompt_spec(name, enable_think=False), [0] * 24, [0] * 24,
                             max_turns=4, max_actions_per_turn=2)
                 for name, kw in (("frozenlake", {"is_slippery": False}), ("sokoban", {}))]
        cfg = RolloutConfig(mode="async", partial=True, max_staleness=2, partial_kv=mode)
        pool = RolloutPool(parts, engine, tok, params, cfg, group, width=12)
        trajs, prefill, starts = [], [], []
        carried: dict[int, int] = {}  # session id -> its cached columns at the last push
        feeds = engine._prefill

        def spy(rows, feeds=feeds, carried=carried, starts=starts, engine=engine):
            """Record the column where each carried session's first prefill after the push starts."""
            for slot, _ids in rows:
                sid = engine._pool.owner[slot]
                if sid in carried:
                    starts.append((int(engine._pool.lengths[slot]), carried.pop(sid)))
            return feeds(rows)

        engine._prefill = spy
        for call in range(4):
            batches, stats = pool.run(target=4, drain=call == 3)
            trajs += [t for b in batches for t in b.trajectories]
            prefill.append(stats.engine.prefill_tokens)
            carried.clear()
            carried.update({sid: s.cached for sid, s in engine._sessions.items() if s.cached})
            engine.sync_weights(model, keep_cache=mode == "keep")
        assert pool.in_flight() == 0 and starts
        pool.close()
        runs[mode] = trajs, prefill, starts
    (rt, rp, rs), (kt, kp, ks) = runs["recompute"], runs["keep"]
    assert [t.input_ids.tolist() for t in rt] == [t.input_ids.tolist() for t in kt]
    assert [t.versions.tolist() for t in rt] == [t.versions.tolist() for t in kt]
    assert all(start == 0 < cached for start, cached in rs)  # recompute: every carried context re-prefilled
    assert all(start == cached > 0 for start, cached in ks)  # keep: prefill starts after the kept columns
    assert kp[0] == rp[0] and all(k < r for k, r in zip(kp[1:], rp[1:], strict=True))
