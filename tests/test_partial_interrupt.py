"""Turns cut at the iteration boundary (``rollout.partial_interrupt``): ``HFEngine.interrupt`` ends the requests in
flight with what they sampled, ``submit(..., resume=...)`` continues them. Under unchanged weights a cut turn
equals the uninterrupted one token for token (same seed stream, same cache); after a push its later tokens are
the new model's, each token records its version. The pool cuts at its stop rule and its trajectories match the
pool without cuts under unchanged weights; the config refuses the option where it cannot work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastpo.envs as E
from fastpo.config import ConfigError, RolloutConfig
from fastpo.config_load import parse_args
from fastpo.engine import HFEngine, SamplingParams
from fastpo.engine.base import GenerationResult
from fastpo.model import load_policy, load_tokenizer, resolve_model_path
from fastpo.preflight import validate
from fastpo.prompts import prompt_spec
from fastpo.rollout import RolloutPart
from fastpo.rollout_pool import NewGroup, RolloutPool
from fastpo.testing import clone_model

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
SEEDS = [100, 101, 102]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(two_tiny_models):
    """(tokenizer, model, other model) (conftest's ``two_tiny_models``)."""
    return two_tiny_models


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (17, 9, 23)]


def _run(model, tok, cut_at: int | None, push=None, keep: bool = True, params: SamplingParams = PARAMS):
    """Three sessions, one turn each; after `cut_at` engine steps interrupt everything, optionally push `push`,
    then resume. Returns (engine, session ids, results by request, the interrupted results)."""
    engine = HFEngine(clone_model(model), tok)
    sids = engine.open_sessions(3)
    engine.extend(sids, _prompts(len(tok)))
    for j, sid in enumerate(sids):
        engine.submit(sid, params, SEEDS[j], tag=j)
    results, cut, steps = {}, [], 0
    while engine.num_unfinished():
        if steps == cut_at:
            for c in engine.interrupt():
                if c.result.finish_reason == "interrupted":
                    cut.append(c)
                else:
                    results[c.tag] = c.result
            assert engine.num_unfinished() == 0
            if push is not None:
                engine.sync_weights(push, keep_cache=keep)
            for c in cut:
                engine.submit(c.session_id, params, SEEDS[c.tag], tag=c.tag, resume=c.result)
        results.update({c.tag: c.result for c in engine.step()})
        steps += 1
    return engine, sids, results, cut


@pytest.mark.parametrize("cut_at", [0, 1, 6])
def test_a_cut_turn_under_unchanged_weights_equals_the_uncut_one(tiny, cut_at):
    """Cut while waiting (0: nothing sampled yet), after the first token, or mid-turn: the resumed turn has the very
    tokens and logprobs of the uninterrupted one (the seed's stream continues at the same index, the cache stays)."""
    tok, model, _ = tiny
    _, _, plain, _ = _run(model, tok, None)
    engine, sids, got, cut = _run(model, tok, cut_at)
    # the step that admits a request samples its first token from the prefill and a second one after the decode
    assert len(cut) == 3 and all(len(c.result.token_ids) == (cut_at + 1 if cut_at else 0) for c in cut)
    for j in range(3):
        assert got[j].token_ids == plain[j].token_ids and got[j].logprobs == plain[j].logprobs
        assert got[j].finish_reason == "length" and got[j].versions() == [0] * PARAMS.max_new_tokens
        # the session holds the turn once, not its earlier tokens twice
        assert engine.session_token_ids(sids[j]) == _prompts(len(tok))[j] + plain[j].token_ids


@pytest.mark.parametrize("keep", [True, False])
def test_after_a_push_the_rest_of_the_turn_is_the_new_models(tiny, keep):
    """Cut after 5 tokens, push other weights: the first 5 tokens are the old model's (version 0), the rest version
    1. With the cache dropped (recompute) the later tokens' logprobs are the new model's on the whole context; with
    the cache kept they differ from those (the earlier columns are the old model's)."""
    tok, model, other = tiny
    _, _, plain, _ = _run(model, tok, None)
    engine, sids, got, _ = _run(model, tok, 4, push=other.state_dict(), keep=keep)  # 4 steps: 5 tokens
    changed = 0
    for j, sid in enumerate(sids):
        res = got[j]
        assert res.token_ids[:5] == plain[j].token_ids[:5] and res.logprobs[:5] == plain[j].logprobs[:5]
        assert res.versions() == [0] * 5 + [1] * (PARAMS.max_new_tokens - 5) and res.weight_version == 1
        ids = engine.session_token_ids(sid)
        with torch.no_grad():
            logits = other(torch.tensor([ids[:-1]])).logits[0].float()
        n = len(res.token_ids) - 5
        want = torch.log_softmax(logits[-n:], dim=-1).gather(1, torch.tensor(res.token_ids[5:])[:, None])[:, 0]
        close = torch.allclose(torch.tensor(res.logprobs[5:]), want, atol=1e-5, rtol=0)
        assert close or keep
        changed += not close
    assert changed > 0 if keep else changed == 0


def test_stop_strings_and_the_token_budget_span_the_cut(tiny):
    """A resumed request counts its earlier tokens against max_new_tokens and matches stop strings over the whole
    turn: cutting anywhere ends the turn where the uncut one ends."""
    tok, model, _ = tiny
    text_params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, stop=("e",))
    _, _, plain, _ = _run(model, tok, None, params=text_params)
    assert any(r.stop_string for r in plain.values())  # some turn really ended on the string
    for cut_at in (1, 3, 8):
        _, _, got, _ = _run(model, tok, cut_at, params=text_params)
        for j in range(3):
            assert got[j].token_ids == plain[j].token_ids and got[j].stop_string == plain[j].stop_string
            assert got[j].finish_reason == plain[j].finish_reason


def test_resume_refuses_what_is_not_the_sessions_cut_turn(tiny):
    tok, model, _ = tiny
    engine = HFEngine(clone_model(model), tok)
    sid = engine.open_sessions(1)[0]
    engine.extend([sid], _prompts(len(tok))[:1])
    done = GenerationResult(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="length")
    with pytest.raises(ValueError, match="resume takes an interrupted turn's result, got finish_reason 'length'"):
        engine.submit(sid, PARAMS, 0, resume=done)
    stranger = GenerationResult(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="interrupted")
    with pytest.raises(ValueError, match=f"resume: session {sid} does not end with the interrupted turn's 2 tokens"):
        engine.submit(sid, PARAMS, 0, resume=stranger)
    assert engine.num_unfinished() == 0


CUT = ["--rollout.mode", "async", "--rollout.partial", "true", "--rollout.partial_interrupt", "true"]


@pytest.mark.parametrize("flags,message", [
    (["--rollout.partial_interrupt", "true"], "rollout.partial_interrupt=true needs rollout.partial=true"),
    ([*CUT, "--rollout.engine", "vllm"], "rollout.partial_interrupt=true needs rollout.engine=hf, got vllm"),
    ([*CUT, "--rollout.max_context_window", "2"],
     r"rollout.partial_interrupt=true needs a context that grows turn by turn .*got full, 2, False"),
    ([*CUT, "--rollout.canonical", "true"],
     r"rollout.partial_interrupt=true needs a context that grows turn by turn .*got full, -1, True"),
])
def test_interrupt_is_refused_where_it_cannot_work(flags, message):
    """The flags as a user types them, refused by the config check before any model loads."""
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(["--preset", "tiny", *flags]), 1)


def test_the_pool_refuses_an_engine_that_cannot_interrupt(tiny):
    tok, model, _ = tiny

    class Plain:  # the lock-step fallback interface only
        weight_version = 0

    part = RolloutPart(E.make("bandit", 3), prompt_spec("bandit", enable_think=False), [0] * 3, [0] * 3)
    cfg = RolloutConfig(mode="async", partial=True, partial_interrupt=True)
    with pytest.raises(ValueError, match="rollout.partial_interrupt needs an engine that can interrupt"):
        RolloutPool([part], Plain(), tok, PARAMS, cfg, lambda n: NewGroup(0, n, n, (n,)), width=3)


@pytest.mark.slow
def tiny_agent_pool(seed: int, request_seed: int, instances: int):
    """The shipped tiny agent over two env parts (non-slippery FrozenLake, Sokoban) for RolloutPool tests:
    (tokenizer, model, sampling params, group source, a factory of fresh parts with `instances` each). Groups of 3
    alternate between the parts; group n has env seed ``seed + n`` and request seeds from ``request_seed``."""
    path = resolve_model_path("tiny")
    tok, model = load_tokenizer(path), load_policy(path).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("</answer>",))

    def group(n: int) -> NewGroup:
        return NewGroup(part=n % 2, seed=seed + n, group=n,
                        request_seeds=tuple(request_seed + 3 * n + j for j in range(3)))

    def make_parts() -> list[RolloutPart]:
        return [RolloutPart(E.make(name, instances, **kw), prompt_spec(name, enable_think=False), [0] * instances,
                            [0] * instances, max_turns=4, max_actions_per_turn=2)
                for name, kw in (("frozenlake", {"is_slippery": False}), ("sokoban", {}))]

    return tok, model, params, group, make_parts


def test_the_pool_cuts_at_its_stop_rule_and_keeps_every_token():
    """The tiny agent on FrozenLake and Sokoban, a push of the same weights (cache kept) between calls: with cuts,
    the calls end without waiting for the turns in flight (some turns span two versions), and every group's
    trajectories have the tokens of the pool without cuts (a cut turn continues its seed's stream), their logprobs
    within float differences."""
    tok, model, params, group, make_parts = tiny_agent_pool(seed=50, request_seed=7000, instances=24)
    runs = {}
    for cut in (False, True):
        engine = HFEngine(model, tok)
        parts = make_parts()
        cfg = RolloutConfig(mode="async", partial=True, max_staleness=2, partial_kv="keep", partial_interrupt=cut)
        pool = RolloutPool(parts, engine, tok, params, cfg, group, width=12)
        trajs, stats = {}, []
        for call in range(4):
            batches, st = pool.run(target=4, drain=call == 3)
            stats.append(st)
            for t in (t for b in batches for t in b.trajectories):  # a group's members in member order
                trajs.setdefault(t.group, []).append(t)
            engine.sync_weights(model, keep_cache=True)
        assert pool.in_flight() == 0 and engine.num_unfinished() == 0 and not pool.cut
        pool.close()
        runs[cut] = trajs, stats
    (plain, plain_stats), (cut, cut_stats) = runs[False], runs[True]
    assert sum(s.tail_turns for s in plain_stats) > 0 and sum(s.interrupted for s in cut_stats) > 0
    assert all(s.tail_turns == 0 for s in cut_stats[:-1])  # no call waited for a turn in flight
    split, common = 0, sorted(plain.keys() & cut.keys())
    for a, b in ((a, b) for g in common for a, b in zip(plain[g], cut[g], strict=True)):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        # a cut turn's last token is fed again by a prefill instead of a decode step: float differences only
        np.testing.assert_allclose(a.sample_logprobs, b.sample_logprobs, atol=1e-4, rtol=0)
        assert np.all(b.versions[b.loss_mask] >= 0)
        split += _turn_spans_versions(b)
    assert len(common) >= 8 and split > 0


def _turn_spans_versions(t) -> bool:
    """True when one sampled run (a turn) of `t` holds tokens of two weight versions."""
    v, m = t.versions, t.loss_mask.astype(bool)
    runs = np.split(np.arange(len(m)), np.flatnonzero(np.diff(m.astype(np.int8))) + 1)
    return any(m[r[0]] and len(set(v[r].tolist())) > 1 for r in runs)
