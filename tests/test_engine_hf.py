"""fastpo.engine.hf.HFEngine on a tiny Qwen2 model: exactness against full forwards and HF generate, seeded
sampling, multi-turn KV reuse, stopping rules, top-k / top-p."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastpo import testing
from fastpo.engine import Engine, HFEngine, SamplingParams
from fastpo.engine.hf import request_uniforms, sample_tokens
from fastpo.model import load_policy, load_tokenizer

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_engine")
    tok = testing.build_tiny_tokenizer(path)
    # A wider init than the default 0.02 gives peaked next-token distributions, so greedy comparisons are not
    # decided by near-ties.
    testing.build_tiny_model(path, tok, seed=0, initializer_range=0.2)
    return path, load_tokenizer(path), load_policy(path).eval()


def _prompts(n: int, vocab: int, seed: int = 0, lengths=(17, 5, 11, 1, 23, 8)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _full_forward_logprobs(model, context: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at `generated`, the last len(generated) tokens of `context`, from one fresh forward."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0].float()
    n = len(generated)
    logp = torch.log_softmax(logits / temperature, dim=-1)[-n - 1 : -1]
    return logp.gather(1, torch.tensor(generated)[:, None]).squeeze(1)


def test_engine_implements_interface(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    assert isinstance(engine, Engine) and engine.weight_version == 0
    assert set(engine.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id}


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12)],
)
def test_greedy_equals_hf_generate(tiny, params):
    _, tok, model = tiny
    prompts = _prompts(4, len(tok))
    results = HFEngine(model, tok).generate(prompts, params, seeds=[0, 1, 2, 3])
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id
            )
        expected = out[0, len(prompt) :].tolist()
        assert result.token_ids == expected[: len(result.token_ids)]
        assert result.finish_reason == ("stop" if len(result.token_ids) < 12 else result.finish_reason)
        torch.testing.assert_close(
            torch.tensor(result.logprobs),
            _full_forward_logprobs(model, prompt + result.token_ids, result.token_ids, 1.0),
            atol=ATOL,
            rtol=0,
        )


def test_seeded_sampling_reproducible_and_batch_invariant(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    prompts = _prompts(5, len(tok))
    batch = engine.generate(prompts, params, seeds=[10, 11, 12, 13, 14])
    again = engine.generate(prompts, params, seeds=[10, 11, 12, 13, 14])
    assert [r.token_ids for r in batch] == [r.token_ids for r in again]
    for i in range(5):
        alone = engine.generate([prompts[i]], params, seeds=[10 + i])[0]
        assert alone.token_ids == batch[i].token_ids
        np.testing.assert_allclose(alone.logprobs, batch[i].logprobs, atol=ATOL)
    shuffled = engine.generate(prompts[::-1], params, seeds=[14, 13, 12, 11, 10])
    assert [r.token_ids for r in shuffled[::-1]] == [r.token_ids for r in batch]
    other = engine.generate(prompts, params, seeds=[20, 21, 22, 23, 24])
    assert [r.token_ids for r in other] != [r.token_ids for r in batch]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 50, 0.9)])
def test_logprobs_equal_full_forward(tiny, temperature, top_k, top_p):
    _, tok, model = tiny
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=9)
    prompts = _prompts(3, len(tok), seed=5)
    for prompt, result in zip(prompts, HFEngine(model, tok).generate(prompts, params, seeds=[1, 2, 3]), strict=True):
        context = prompt + result.token_ids
        expected = _full_forward_logprobs(model, context, result.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=ATOL, rtol=0)
        raw = _full_forward_logprobs(model, context, result.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(result.raw_logprobs), raw, atol=ATOL, rtol=0)


def _multi_turn(engine: HFEngine, prompts, observations, params) -> tuple[list, list[list[int]]]:
    """Four turns over three sessions; turn 2 generates a reordered subset (forcing a regroup) and session 1
    gets two observations at once. Returns per session [(start offset in its context, result)] and the contexts."""
    sids = engine.open_sessions(3)
    per_session: list[list] = [[], [], []]

    def generate(which: list[int], seeds: list[int]) -> None:
        starts = [len(engine.session_token_ids(sids[i])) for i in which]
        results = engine.generate_sessions([sids[i] for i in which], params, seeds)
        for i, start, result in zip(which, starts, results, strict=True):
            per_session[i].append((start, result))

    engine.extend(sids, prompts)
    generate([0, 1, 2], [1, 2, 3])
    engine.extend(sids, observations[0])
    generate([2, 0], [13, 11])
    engine.extend([sids[0], sids[2]], [observations[1][0], observations[1][2]])
    engine.extend([sids[1]], [observations[0][1] + observations[1][1]])
    generate([0, 1, 2], [21, 22, 23])
    engine.extend(sids, observations[2])
    generate([0, 1, 2], [31, 32, 33])
    contexts = [engine.session_token_ids(s) for s in sids]
    engine.close_sessions(sids)
    return per_session, contexts


@pytest.mark.parametrize(
    "options",
    [{}, {"max_prefill_tokens": 16}, {"max_batch_size": 1}, {"max_batch_size": 2}],
    ids=["default", "chunked_prefill", "one_slot", "batch_chunks"],
)
def test_kv_reuse_multi_turn_equals_reprefill_and_full_forward(tiny, options):
    _, tok, model = tiny
    # ~10% of the vocab stops a request, so rows finish at different steps and leave holes in the cache
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(range(3, 60)))
    prompts = _prompts(3, len(tok), seed=7, lengths=(20, 7, 13))
    obs = [
        _prompts(3, len(tok), seed=8 + t, lengths=lengths)
        for t, lengths in enumerate([(3, 9, 1), (5, 2, 8), (4, 1, 6)])
    ]
    turns_reuse, ctx_reuse = _multi_turn(HFEngine(model, tok, reuse_kv=True, **options), prompts, obs, params)
    turns_fresh, ctx_fresh = _multi_turn(HFEngine(model, tok, reuse_kv=False), prompts, obs, params)
    assert ctx_reuse == ctx_fresh
    reasons = {r.finish_reason for turns in turns_reuse for _, r in turns}
    assert reasons == {"stop", "length"}
    for session_a, session_b in zip(turns_reuse, turns_fresh, strict=True):
        for (_, a), (_, b) in zip(session_a, session_b, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL)
    # every sampled token of every turn against one forward over the final context
    for ctx, session_turns in zip(ctx_reuse, turns_reuse, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx])).logits[0].float(), dim=-1)
        for start, result in session_turns:
            n = len(result.token_ids)
            assert ctx[start : start + n] == result.token_ids
            expected = logp[start - 1 : start - 1 + n].gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=ATOL, rtol=0)


def test_kv_buffers_stay_finite_with_padding(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    sids = engine.open_sessions(3)
    engine.extend(sids, _prompts(3, len(tok), lengths=(1, 30, 4)))
    engine.generate_sessions(sids, SamplingParams(max_new_tokens=5), seeds=[0, 1, 2])
    for layer in engine._pool.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_stop_tokens_and_max_new_tokens(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    prompt = _prompts(1, len(tok), seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    free = engine.generate(prompt, greedy)[0]
    assert len(free.token_ids) == 6 and free.finish_reason == "length"
    # the last position whose token did not occur before it: stopping on that token stops exactly there
    stop_at = max(i for i, t in enumerate(free.token_ids) if free.token_ids.index(t) == i)
    stop_token = free.token_ids[stop_at]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, stop_token_ids=(stop_token,))
    stopped = engine.generate(prompt, params)[0]
    assert stopped.token_ids == free.token_ids[: stop_at + 1] and stopped.finish_reason == "stop"
    eos_engine = HFEngine(model, tok, eos_token_ids=[stop_token])
    as_eos = eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert as_eos.token_ids == stopped.token_ids and as_eos.finish_reason == "stop"
    assert eos_engine.generate(prompt, greedy)[0].token_ids == free.token_ids  # ignore_eos
    capped = SamplingParams(max_new_tokens=3, ignore_eos=True)
    sampled = engine.generate(_prompts(4, len(tok)), capped, seeds=[1, 2, 3, 4])
    assert all(len(r.token_ids) == 3 and r.finish_reason == "length" for r in sampled)
    # sessions: the cap applies per call (per turn)
    sids = engine.open_sessions(1)
    engine.extend(sids, prompt)
    for turn in range(2):
        assert (
            len(engine.generate_sessions(sids, SamplingParams(max_new_tokens=2, ignore_eos=True), [turn])[0].token_ids)
            == 2
        )
    assert len(engine.session_token_ids(sids[0])) == len(prompt[0]) + 4


def test_top_k_top_p_never_sample_outside_allowed_set():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    uniforms = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    cases = [  # (temperature, top_k, top_p) -> allowed tokens and their renormalised probabilities
        ((1.0, 0, 0.7), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        ((1.0, 2, 1.0), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        ((1.0, 3, 0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # top-p on the top-k renormalised distribution
        ((1.0, 0, 0.5), [1.0, 0, 0, 0]),
        ((1.0, 0, 1.0), [0.5, 0.3, 0.15, 0.05]),
    ]
    for (temperature, top_k, top_p), expected in cases:
        tokens, logp, raw = sample_tokens(logits, uniforms, temperature, top_k, top_p)
        freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
        assert all(freq[i] == 0 for i in range(4) if expected[i] == 0), (top_k, top_p, freq)
        np.testing.assert_allclose(freq.numpy(), expected, atol=1e-3)
        # logprobs stay log_softmax(logits / T) over the full vocab, not renormalised
        torch.testing.assert_close(logp, probs.log()[tokens], atol=1e-6, rtol=0)
    hot = sample_tokens(logits, uniforms, 2.0, 0, 1.0)
    torch.testing.assert_close(hot[1], torch.log_softmax(probs.log() / 2.0, -1)[hot[0]], atol=1e-6, rtol=0)
    torch.testing.assert_close(hot[2], probs.log()[hot[0]], atol=1e-6, rtol=0)
    extremes = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    tokens, _, _ = sample_tokens(torch.tensor([[0.0, 0.0, -math.inf, 0.0, -math.inf]] * 2), extremes, 1.0)
    assert tokens.tolist() == [0, 3]


def test_request_uniforms():
    u = request_uniforms([0, 1, 2**70, -5], 1000)
    assert u.shape == (4, 1000) and (u >= 0).all() and (u < 1).all()
    np.testing.assert_array_equal(u[1], request_uniforms([1], 1000)[0])
    assert abs(u.mean() - 0.5) < 0.02 and not np.array_equal(u[0], u[1])
    np.testing.assert_array_equal(u[:, :10], request_uniforms([0, 1, 2**70, -5], 10))


def test_sync_weights_updates_and_reprefills(tiny, tmp_path):
    path, tok, model = tiny
    engine = HFEngine(load_policy(path).eval(), tok)
    new_model = testing.build_tiny_model(tmp_path / "new", tok, seed=5, initializer_range=0.2)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    prompt = _prompts(1, len(tok), seed=9)
    sids = engine.open_sessions(1)
    engine.extend(sids, prompt)
    engine.generate_sessions(sids, params, [0])
    assert engine.sync_weights(new_model.state_dict()) == 1 and engine.weight_version == 1
    engine.extend(sids, [[5, 6, 7]])
    result = engine.generate_sessions(sids, params, [1])[0]
    assert result.weight_version == 1
    ctx = engine.session_token_ids(sids[0])
    expected = _full_forward_logprobs(new_model, ctx, result.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=ATOL, rtol=0)
    assert engine.sync_weights(new_model) == 2
    with pytest.raises(ValueError, match="missing"):
        engine.sync_weights({"model.norm.weight": torch.ones(model.config.hidden_size)})


def test_bad_inputs_raise(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate([[1, 2]], SamplingParams(), seeds=[1, 2])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine.generate([[len(tok) + 5]], SamplingParams())
    sids = engine.open_sessions(1)
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate_sessions(sids, SamplingParams())
    engine.close_sessions(sids)
    with pytest.raises(ValueError, match="unknown or closed"):
        engine.extend(sids, [[1]])


@pytest.mark.gpu
def test_cuda_engine_matches_cpu(tiny):
    path, tok, model = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    prompts = _prompts(4, len(tok), seed=11)
    cpu = HFEngine(model, tok).generate(prompts, params, seeds=[1, 2, 3, 4])
    gpu = HFEngine(load_policy(path).eval().cuda(), tok).generate(prompts, params, seeds=[1, 2, 3, 4])
    for a, b in zip(cpu, gpu, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_stop_strings_end_at_the_completing_token(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    assert testing.check_stop_strings(engine, tok, _prompts(12, len(tok), seed=5)) >= 1
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(model).generate(_prompts(1, len(tok)), SamplingParams(max_new_tokens=2, stop=("ab",)))
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop=("",))


def test_shared_prompts_prefill_once_and_match_separate_calls(tiny):
    """Rows that repeat a prompt (a GRPO group) are prefilled once and their KV copied; sampling, logprobs and a
    second turn match generating each request on its own (the same seeds)."""
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    a, b = _prompts(2, len(tok), seed=9, lengths=(13, 6))
    prompts, seeds = [a, a, b, a, b], [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    calls = []
    original = engine._prefill_rows
    engine._prefill_rows = lambda rows: calls.append(len(rows)) or original(rows)
    sids = engine.open_sessions(len(prompts))
    engine.extend(sids, prompts)
    first = engine.generate_sessions(sids, params, seeds)
    engine.extend(sids, [[7, 8]] * len(prompts))
    second = engine.generate_sessions(sids, params, [s + 10 for s in seeds])
    assert calls[0] == 2  # two distinct prompts computed, not five
    for i, (p, s) in enumerate(zip(prompts, seeds, strict=True)):
        alone = HFEngine(model, tok)
        sid = alone.open_sessions(1)
        alone.extend(sid, [p])
        r1 = alone.generate_sessions(sid, params, [s])[0]
        alone.extend(sid, [[7, 8]])
        r2 = alone.generate_sessions(sid, params, [s + 10])[0]
        for got, want in ((first[i], r1), (second[i], r2)):
            assert got.token_ids == want.token_ids, i
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


# ---- the asynchronous interface: continuous batching ---------------------------------------------------------


def _alone(model, tok, prompt, turns, params):
    """Each turn of one session generated on an engine of its own: [(observation, seed)] -> results."""
    engine = HFEngine(model, tok)
    sid = engine.open_sessions(1)
    engine.extend(sid, [prompt])
    out = []
    for k, (obs, seed) in enumerate(turns):
        if k:
            engine.extend(sid, [obs])
        out.append(engine.generate_sessions(sid, params, [seed])[0])
    return out


@pytest.mark.parametrize("max_batch_size,admit_wait", [(None, 0), (2, 0), (None, 2), (None, 3)],
                         ids=["grow", "two_slots", "default", "admit_wait_3"])
def test_continuous_batching_tokens_depend_on_seed_and_context_only(tiny, max_batch_size, admit_wait):
    """Sessions join while others decode (a session's next turn is submitted the step its turn completes, a new
    session joins half way); every request's tokens equal the same request generated alone, logprobs within 1e-5,
    whatever else shared the batch, with slots freed and reused."""
    _, tok, model = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=tuple(range(3, 40)))
    prompts = _prompts(5, len(tok), seed=21, lengths=(9, 3, 14, 6, 11))
    obs = _prompts(10, len(tok), seed=22, lengths=(2, 5, 1, 7, 3))
    plan = {i: [(None, 100 + i)] + [(obs[2 * i + t], 200 + 10 * i + t) for t in range(2)] for i in range(5)}
    engine = HFEngine(model, tok, max_batch_size=max_batch_size, admit_wait=admit_wait)
    sids = engine.open_sessions(5)
    engine.extend(sids, prompts)
    got: dict[int, list] = {i: [] for i in range(5)}
    for i in range(3):  # sessions 3 and 4 join later
        engine.submit(sids[i], params, plan[i][0][1], tag=i)
    steps = 0
    while engine.num_unfinished():
        steps += 1
        if steps == 3:
            for i in (3, 4):
                engine.submit(sids[i], params, plan[i][0][1], tag=i)
        for done in engine.step():
            i = done.tag
            assert done.session_id == sids[i]
            got[i].append(done.result)
            turn = len(got[i])
            if turn < len(plan[i]):
                engine.extend([sids[i]], [plan[i][turn][0]])
                engine.submit(sids[i], params, plan[i][turn][1], tag=i)
    assert engine.step() == []
    reasons = set()
    for i in range(5):
        want = _alone(model, tok, prompts[i], plan[i], params)
        assert [r.token_ids for r in got[i]] == [r.token_ids for r in want], i
        for a, b in zip(got[i], want, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=ATOL)
            reasons.add(a.finish_reason)
    assert reasons == {"stop", "length"}
    stats = engine.stats
    assert stats.tokens == sum(len(r.token_ids) for rs in got.values() for r in rs)
    assert stats.first_tokens == 15 and 0 < stats.occupancy() <= 1 and 0 < stats.slot_occupancy() <= 1
    if max_batch_size:
        assert engine._pool.slots == 2
    engine.close_sessions(sids)


def test_max_batch_size_caps_the_slots_when_the_pool_grows_step_by_step(tiny):
    """Requests arriving one per step make the slot pool grow several times (by ``growth``); it never holds more
    than max_batch_size slots, and no more requests than that run together (the pool grew 4 -> 6 past a cap of 5
    once: the growth factor was applied twice)."""
    _, tok, model = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    engine = HFEngine(model, tok, max_batch_size=5, admit_wait=0)
    sids = engine.open_sessions(9)
    engine.extend(sids, _prompts(9, len(tok), seed=5))
    most_slots = most_running = 0
    pending = list(enumerate(sids))
    while pending or engine.num_unfinished():
        if pending:
            i, sid = pending.pop(0)
            engine.submit(sid, params, 40 + i, tag=i)
        engine.step()
        most_slots, most_running = max(most_slots, engine._pool.slots), max(most_running, len(engine._running))
    assert most_slots == 5 and most_running == 5


def test_admit_wait_holds_a_lone_arrival_and_admits_a_large_queue_at_once(tiny):
    """admit_wait=2: one request submitted while four decode waits two steps before its prefill; three submitted
    together while five decode (at least half as many) join at once. admit_wait=0: every arrival is prefilled the
    step after it came. The tokens are the same either way."""
    _, tok, model = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)  # nothing finishes in 6 steps
    prompts = _prompts(8, len(tok), seed=31, lengths=(5, 6, 7, 8, 4, 3, 6, 5))

    def run(admit_wait: int) -> tuple[list[int], dict]:
        engine = HFEngine(model, tok, admit_wait=admit_wait)
        sids = engine.open_sessions(8)
        engine.extend(sids, prompts)
        arrivals = {1: [0, 1, 2, 3], 2: [4], 5: [5, 6, 7]}
        prefilled, tokens = [], {}
        for step in range(1, 7):
            for i in arrivals.get(step, []):
                engine.submit(sids[i], params, 40 + i, tag=i)
            before = engine.stats.prefill_tokens
            engine.step()
            prefilled.append(engine.stats.prefill_tokens - before)
        while engine.num_unfinished():
            tokens.update((c.tag, c.result.token_ids) for c in engine.step())
        engine.close_sessions(sids)
        return prefilled, tokens

    n = [len(p) for p in prompts]
    eager, tokens0 = run(0)
    assert eager == [sum(n[:4]), n[4], 0, 0, sum(n[5:]), 0]
    held, tokens2 = run(2)
    assert held == [sum(n[:4]), 0, 0, n[4], sum(n[5:]), 0]
    assert tokens2 == tokens0 and len(tokens0) == 8
    with pytest.raises(ValueError, match="admit_wait must be an int >= 0"):
        HFEngine(model, tok, admit_wait=-1)


def test_continuous_batching_beats_lock_step_occupancy(tiny):
    """Lock-step turns keep finished rows as padding until the longest row stops; continuous batching refills the
    slot: on rows of very different lengths it computes fewer idle rows per useful token."""
    _, tok, model = tiny
    lengths = [2, 2, 2, 16]
    prompts = _prompts(4, len(tok), seed=3)
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    lock = HFEngine(model, tok)
    for _ in range(3):  # three rounds of one batch each: rows wait for the longest
        for p, sp in zip(prompts, params, strict=True):
            sid = lock.open_sessions(1)
            lock.extend(sid, [p])
            lock.submit(sid[0], sp, 1)
        while lock.num_unfinished():
            lock.step()
    cont = HFEngine(model, tok, max_batch_size=4)
    queue = [(p, sp) for _ in range(3) for p, sp in zip(prompts, params, strict=True)]
    for p, sp in queue[:4]:
        sid = cont.open_sessions(1)
        cont.extend(sid, [p])
        cont.submit(sid[0], sp, 1)
    queue = queue[4:]
    while cont.num_unfinished():
        for done in cont.step():
            cont.close_sessions([done.session_id])
            if queue:
                p, sp = queue.pop(0)
                sid = cont.open_sessions(1)
                cont.extend(sid, [p])
                cont.submit(sid[0], sp, 1)
    assert lock.stats.tokens == cont.stats.tokens == 3 * sum(lengths)
    assert cont.stats.occupancy() > lock.stats.occupancy()
    assert cont.stats.decode_steps < lock.stats.decode_steps


def test_a_next_turn_submitted_after_a_completion_takes_the_slot_before_the_next_decode(tiny):
    """Two episodes take turns of 3 and of 5 tokens, each next turn submitted as soon as the step that returned the
    last one ends (the async driver's loop). The freed slot is prefilled before the next decode forward, so no slot
    ever idles: useful decoded tokens == decode steps x slots, exactly. (When the decode ran before the next
    admission, a turn's end could leave its slot idle for a decode step: 8 of 32 slot-steps here.) A turn of L tokens
    takes L - 1 steps; the two chains end on the same step."""
    _, tok, model = tiny
    engine = HFEngine(model, tok, admit_wait=0)
    sids = engine.open_sessions(2)
    engine.extend(sids, _prompts(2, len(tok), seed=8))
    chains = {sids[0]: [3] * 6, sids[1]: [5] * 3}  # 6 x 2 steps == 3 x 4 steps
    for sid in sids:
        engine.submit(sid, SamplingParams(temperature=1.0, max_new_tokens=chains[sid].pop(), ignore_eos=True), sid)
    steps = 0
    while engine.num_unfinished():
        steps += 1
        for done in engine.step():
            assert len(done.result.token_ids) in (3, 5)
            if chains[done.session_id]:
                engine.extend([done.session_id], [[7, 8]])  # the observation
                n = chains[done.session_id].pop()
                engine.submit(done.session_id, SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True),
                              100 + steps)
    stats = engine.stats
    assert steps == stats.decode_steps == 12 and stats.tokens == 6 * 3 + 3 * 5 and stats.first_tokens == 9
    assert stats.slot_steps == stats.row_steps == 2 * 12 == stats.tokens - stats.first_tokens
    assert stats.slot_occupancy() == 1.0


def test_async_interface_errors_and_abort(tiny):
    _, tok, model = tiny
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    sids = engine.open_sessions(3)
    engine.extend(sids, _prompts(3, len(tok), seed=4))
    engine.submit(sids[0], params, 1)
    with pytest.raises(ValueError, match="already has a request in flight"):
        engine.submit(sids[0], params, 2)
    with pytest.raises(ValueError, match="in flight"):
        engine.generate_sessions([sids[0]], params, [3])
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.submit(sids[1], {"temperature": 1.0}, 1)
    empty = engine.open_sessions(1)
    with pytest.raises(ValueError, match="no tokens"):
        engine.submit(empty[0], params, 1)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sync_weights(model)
    before = engine.session_token_ids(sids[0])
    engine.abort()
    assert engine.num_unfinished() == 0 and engine.session_token_ids(sids[0]) == before
    # usable afterwards, and a request generated after the abort equals a fresh engine's
    engine.submit(sids[0], params, 7, tag="x")
    engine.submit(sids[1], params, 8, tag="y")
    engine.close_sessions([sids[1]])  # closing a session drops its request
    done = []
    while engine.num_unfinished():
        done += engine.step()
    assert [d.tag for d in done] == ["x"]
    fresh = HFEngine(model, tok)
    sid = fresh.open_sessions(1)
    fresh.extend(sid, [before])
    assert done[0].result.token_ids == fresh.generate_sessions(sid, params, [7])[0].token_ids


def test_tail_rows_move_down_to_free_slots_and_keep_their_tokens(tiny):
    """At a rollout's tail the last running row sits in a high slot while the low ones are free: it is moved down
    (one copy of its cache), the decode range shrinks, and its tokens and logprobs equal a request generated
    alone."""
    _, tok, model = tiny
    prompts = _prompts(6, len(tok), seed=31)
    short = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    engine = HFEngine(model, tok)
    sids = engine.open_sessions(6)
    engine.extend(sids, prompts)
    for i, sid in enumerate(sids):
        engine.submit(sid, long if i == 5 else short, 40 + i, tag=i)
    results, ranges = {}, []
    while engine.num_unfinished():
        for done in engine.step():
            results[done.tag] = done.result
            if done.tag != 5:
                engine.close_sessions([done.session_id])  # an ended episode frees its slot
        ranges.append(max(engine._running, default=-1) + 1)
    assert engine._sessions[sids[5]].slot == 0 and ranges[-2] == 1  # moved from slot 5 to slot 0
    alone = HFEngine(model, tok).generate([prompts[5]], long, [45])[0]
    assert results[5].token_ids == alone.token_ids
    np.testing.assert_allclose(results[5].logprobs, alone.logprobs, atol=ATOL)
    assert engine.stats.row_steps < 6 * engine.stats.decode_steps


def test_a_model_in_training_mode_samples_in_eval_mode_and_gets_its_mode_back(tiny):
    """The engine runs a training-mode model in eval mode (dropout off: the same tokens as the eval-mode model) and
    hands it back in training mode; an eval-mode model is left as it is."""
    _, tok, model = tiny
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    prompts = _prompts(3, model.config.vocab_size)
    model.eval()
    expected = [r.token_ids for r in HFEngine(model, tok).generate(prompts, params, seeds=[1, 2, 3])]
    assert not model.training
    attention = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attention
    for m in attention:
        m.attention_dropout = 0.5  # would change the tokens if the engine sampled in training mode
    model.train()
    try:
        seen = []
        hook = model.model.register_forward_pre_hook(lambda m, _: seen.append(m.training))
        got = [r.token_ids for r in HFEngine(model, tok).generate(prompts, params, seeds=[1, 2, 3])]
        hook.remove()
        assert got == expected and seen and not any(seen)
        assert model.training and all(m.training for m in model.modules())
    finally:
        for m in attention:
            m.attention_dropout = 0.0
        model.eval()
