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
    # the decode steps sum the same terms in another order (grouped heads): fp32 rounding, measured 2.9e-6
    assert worst <= 1e-5, worst
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length", [1, 5])  # a decode step (grouped heads) and a prefill chunk (enable_gqa)
def test_gqa_sdpa_matches_an_fp32_reference_with_the_engines_mask(dtype, tol, length):
    """Rows of different valid widths (the engine's additive mask, a fully masked tail), 12 heads on 2 KV heads,
    odd sizes; the truth repeats the KV heads and runs softmax in fp32."""
    g = torch.Generator().manual_seed(7)
    rows, heads, kv_heads, dim, width = 3, 12, 2, 16, 37
    q = torch.randn(rows, heads, length, dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, width, dim, generator=g) for _ in range(2))
    valid = torch.tensor([37, 5, 20])  # query j of row r sees columns [0, valid_r - length + 1 + j)
    last = valid[:, None, None] - length + torch.arange(length)[None, :, None]  # the last column query j sees
    cols = torch.arange(width)[None, None, :] <= last
    bias = torch.zeros(rows, 1, length, width).masked_fill_(~cols[:, None], torch.finfo(dtype).min)
    out, _ = attention._gqa_sdpa(None, q.to(dtype), k.to(dtype), v.to(dtype), bias.to(dtype), scaling=dim ** -0.5)
    kk, vv = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k.to(dtype).float(), v.to(dtype).float()))
    scores = q.to(dtype).float() @ kk.transpose(-1, -2) * dim ** -0.5
    truth = torch.softmax(scores.masked_fill(~cols[:, None], float("-inf")), -1) @ vv
    assert out.shape == (rows, length, heads, dim) and out.dtype == dtype
    assert (out.float() - truth.transpose(1, 2)).abs().max() <= tol


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
