"""fastpo.engine.packing: how one admission's prefill rows are split into forwards (the cheapest contiguous split of
the size order, never worse than one forward), and the built-in engine using it without changing what it samples."""

from __future__ import annotations

import itertools

import pytest
import torch

from fastpo import testing
from fastpo.engine import HFEngine, SamplingParams
from fastpo.engine.packing import FORWARD_COLUMNS, TOKEN_COLUMNS, forward_cost, split_rows
from fastpo.model import load_policy, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _total(groups, sizes, ends):
    return sum(forward_cost([sizes[i] for i in g], [ends[i] for i in g]) for g in groups)


def test_forward_cost_is_the_padded_positions_times_their_columns_plus_a_forward():
    assert forward_cost([3, 1], [10, 20]) == 2 * 3 * (20 + TOKEN_COLUMNS) + FORWARD_COLUMNS


def test_equal_rows_share_one_forward_and_unequal_ones_split():
    assert split_rows([100] * 5, [900] * 5) == [[0, 1, 2, 3, 4]]
    # a new episode's long first prompt next to short next turns and a continued turn of one token
    sizes, ends = [120, 400, 1, 118, 2], [1100, 400, 950, 800, 1200]
    groups = split_rows(sizes, ends)
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert [1] in groups  # the 400-token prompt pads nobody
    assert any(2 in g and 4 in g for g in groups)  # the 1- and 2-token rows share a forward
    assert _total(groups, sizes, ends) < forward_cost(sizes, ends)
    assert split_rows([], []) == []


@pytest.mark.parametrize("seed", range(40))
def test_split_is_the_cheapest_contiguous_split_of_the_size_order(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 8, (1,), generator=g))
    sizes = torch.randint(1, 500, (n,), generator=g).tolist()
    ends = [s + int(c) for s, c in zip(sizes, torch.randint(0, 3000, (n,), generator=g), strict=True)]
    groups = split_rows(sizes, ends)
    assert sorted(i for grp in groups for i in grp) == list(range(n))
    order = sorted(range(n), key=lambda i: (sizes[i], ends[i]))
    best = min(
        _total([order[a:b] for a, b in itertools.pairwise((0, *cuts, n))], sizes, ends)
        for k in range(n) for cuts in itertools.combinations(range(1, n), k))
    assert _total(groups, sizes, ends) == best
    assert best <= forward_cost(sizes, ends)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="differ in length: 2 vs 1"):
        split_rows([1, 2], [3])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_packing")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, seed=0, initializer_range=0.2)
    return load_tokenizer(path), load_policy(path).eval()


@pytest.mark.parametrize("split", [True, False])
def test_engine_prefills_unequal_rows_in_separate_forwards_with_the_same_samples(tiny, split):
    """A 400-token prompt admitted with two short ones: two forwards (one with ``split_prefill=False``), the padded
    positions counted, and each row samples what it samples alone."""
    tok, model = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (400, 3, 2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True)
    engine = HFEngine(model, tok, split_prefill=split)
    calls = []
    original = engine._prefill_rows
    engine._prefill_rows = lambda rows: calls.append(sorted(len(ids) for _, ids in rows)) or original(rows)
    sids = engine.open_sessions(3)
    engine.extend(sids, prompts)
    got = engine.generate_sessions(sids, params, [1, 2, 3])
    assert sorted(calls) == ([[2, 3], [400]] if split else [[2, 3, 400]])
    assert engine.stats.prefill_tokens == 405
    assert engine.stats.prefill_positions == (400 + 2 * 3 if split else 3 * 400)
    for prompt, seed, result in zip(prompts, [1, 2, 3], got, strict=True):
        alone = HFEngine(model, tok)
        sid = alone.open_sessions(1)
        alone.extend(sid, [prompt])
        want = alone.generate_sessions(sid, params, [seed])[0]
        assert result.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
