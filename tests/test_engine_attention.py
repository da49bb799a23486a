"""The built-in engine's CPU attention with grouped KV heads (fastpo.engine.attention): same tokens and logprobs as
transformers' own sdpa path, used only where it applies, and the model's setting is always restored."""

from __future__ import annotations

import pytest
import torch

from fastpo import testing
from fastpo.engine import attention
from fastpo.engine import hf as hf_engine
from fastpo.engine.base import SamplingParams
from fastpo.model import load_policy, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gqa")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, seed=1, heads=4, kv_heads=2, initializer_range=0.2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_tokenizer(path), load_policy(path).eval()
    torch.set_num_threads(before)


def _run(model, tok, stock: bool, monkeypatch) -> tuple[list[list[int]], list[list[float]]]:
    """Two turns of 5 sessions with prompts of different lengths (so the additive mask matters), under the
    engine's attention, or with it switched off (stock=True: transformers' sdpa with repeated KV heads)."""
    calls = []

    def spy(model, device):
        calls.append(device)
        return attention.gqa_attention(model, device)

    monkeypatch.setattr(hf_engine, "gqa_attention", spy)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (19, 3, 11, 27, 7)]
    engine = hf_engine.HFEngine(model, tok, gqa_sdpa=not stock)
    sids = engine.open_sessions(len(prompts))
    engine.extend(sids, prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True)
    tokens, logps = [], []
    for turn in range(2):
        out = engine.generate_sessions(sids, params, [10 * turn + k for k in range(len(sids))])
        tokens += [r.token_ids for r in out]
        logps += [r.logprobs for r in out]
        engine.extend(sids, [[5 + k, 6] for k in range(len(sids))])
    engine.close()
    assert bool(calls) != stock  # the engine's forwards went through the switch exactly when asked to
    return tokens, logps


def test_gqa_attention_gives_the_tokens_and_logprobs_of_the_stock_path(tiny, monkeypatch):
    tok, model = tiny
    tokens, logps = _run(model, tok, False, monkeypatch)
    ref_tokens, ref_logps = _run(model, tok, True, monkeypatch)
    assert tokens == ref_tokens
    worst = max(abs(a - b) for x, y in zip(logps, ref_logps, strict=True) for a, b in zip(x, y, strict=True))
    assert worst <= 1e-6, worst
    assert model.config._attn_implementation == "sdpa"


def test_gqa_attention_is_used_only_for_grouped_sdpa_on_cpu_and_always_restored(tiny):
    _, model = tiny
    cpu = torch.device("cpu")
    with attention.gqa_attention(model, cpu):
        assert model.config._attn_implementation == attention.NAME
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), attention.gqa_attention(model, cpu):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    with attention.gqa_attention(model, torch.device("cuda")):  # CUDA keeps the model's own attention
        assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with attention.gqa_attention(model, cpu):
            assert model.config._attn_implementation == "eager"
    finally:
        model.config._attn_implementation = "sdpa"


def test_ungrouped_models_keep_their_attention(tmp_path):
    tok = testing.build_tiny_tokenizer(tmp_path)
    testing.build_tiny_model(tmp_path, tok, heads=4, kv_heads=4)
    model = load_policy(tmp_path)
    with attention.gqa_attention(model, torch.device("cpu")):
        assert model.config._attn_implementation == "sdpa"
