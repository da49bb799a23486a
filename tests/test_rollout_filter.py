"""fastpo.rollout_filter: RAGEN-2's group selection against hand-computed kept sets (CPU)."""

import math
import random

import pytest
import torch

from fastpo import algorithms as alg
from fastpo import rollout_filter as rf

IDS = [10, 20, 30, 40, 50, 60]
SCORES = [3.0, 1.0, 0.0, 0.0, 2.0, 1.0]  # ties: 20 / 60 (1.0) and 30 / 40 (zero); order: 10 > 50 > 20 = 60 > 30 = 40


def triplets(metric, scores, ids=IDS, seed=0):
    """Three trajectories per group whose ``metric`` group score is exactly ``scores[i]``, shuffled. Returns the
    select_groups arguments (rewards, group_ids, extra keywords)."""
    rows = []
    for gid, s in zip(ids, scores, strict=True):
        if metric == "reward":
            vals = (s, s, s)
        elif metric == "reward_sum":
            vals = (s, 0.0, 0.0)
        elif metric in ("reward_variance", "reward_std"):
            vals = (-s, 0.0, s)  # mean 0, unbiased var (2 s^2) / 2 = s^2: exact
        elif metric in ("entropy", "length"):
            vals = (s, s, s)
        else:  # entropy_variance
            vals = (5.0 - s, 5.0, 5.0 + s)
        rows += [(gid, v) for v in vals]
    random.Random(seed).shuffle(rows)
    ids_t = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    vals_t = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    if metric in ("entropy", "entropy_variance", "entropy_std"):
        return torch.zeros_like(vals_t), ids_t, {"entropies": vals_t}
    if metric == "length":
        return torch.zeros_like(vals_t), ids_t, {"lengths": vals_t}
    return vals_t, ids_t, {}


def kept_ids(keep, group_ids):
    return sorted(set(group_ids[keep].tolist()))


def run(metric, scores=SCORES, ids=IDS, seed=0, **kw):
    rewards, gids, extra = triplets(metric, scores, ids, seed)
    keep, metrics = rf.select_groups(rewards, gids, metric=metric, **extra, **kw)
    # whole groups only
    for g in set(gids.tolist()):
        assert keep[gids == g].all() or not keep[gids == g].any()
    return kept_ids(keep, gids), metrics


ALL_METRICS = ["reward_variance", "reward", "reward_sum", "entropy", "entropy_variance", "length",
               "reward_std", "entropy_std"]

# (keywords, kept group ids) for SCORES, worked by hand in the comments
CASES = [
    # top_k: k = int(value * 6) best, ties to the lower id; zero groups stay candidates unless include_zero=False
    (dict(strategy="top_k", value=0.5), [10, 20, 50]),  # k=3: 3, 2, then 1 @20 (not 60)
    (dict(strategy="top_k", value=0.5, include_zero=False), [10, 20, 50]),
    (dict(strategy="top_k", value=0.84), [10, 20, 30, 50, 60]),  # k=5: the fifth is a zero, 30 before 40
    (dict(strategy="top_k", value=0.84, include_zero=False), [10, 20, 50, 60]),  # k capped at the 4 candidates
    (dict(strategy="top_k", value=0.05), [10]),  # int(0.3) = 0 -> at least one (RAGEN's clamp)
    (dict(strategy="top_k", value=1.0), IDS),
    (dict(strategy="top_k", value=0.5, filter_type="smallest"), [20, 30, 40]),  # 0, 0, then 1 @20
    (dict(strategy="top_k", value=0.5, filter_type="smallest", include_zero=False), [20, 50, 60]),
    # top_k_abs: a fixed count
    (dict(strategy="top_k_abs", value=2), [10, 50]),
    (dict(strategy="top_k_abs", value=3.0, filter_type="smallest"), [20, 30, 40]),
    (dict(strategy="top_k_abs", value=100, include_zero=False), [10, 20, 50, 60]),
    # top_p linear: threshold = value * sum(7) - eps; walk best first while below it and the score is > 0
    (dict(strategy="top_p", value=0.6), [10, 50]),  # 4.19: 3 -> 5
    (dict(strategy="top_p", value=0.75), [10, 20, 50]),  # 5.24: 3 -> 5 -> 6 (20 before 60)
    (dict(strategy="top_p", value=0.75, include_zero=False), [10, 20, 50]),  # zeros add nothing to the sum
    (dict(strategy="top_p", value=0.99), [10, 20, 50, 60]),  # 6.92: 7 after 60; zeros are never walked
    (dict(strategy="top_p", value=1.0), IDS),  # value 1: every candidate, zero ones too
    (dict(strategy="top_p", value=1.0, include_zero=False), [10, 20, 50, 60]),  # == the legacy nonzero filter
    (dict(strategy="top_p", value=0.5, filter_type="smallest"), []),  # ascending: first score is 0 -> stop, 0 < 3.49
    (dict(strategy="top_p", value=0.5, filter_type="smallest", include_zero=False), [20, 50, 60]),  # 1, 2, 4 >= 3.49
    # top_p softmax: p = softmax(score) = [e^3, e, 1, 1, e^2, e] / 34.911; cumulative best first:
    # .5753 (10) .7870 (50) .8648 (20) .9427 (60) .9713 (30) 1.0 (40); keep through the first cum >= value
    (dict(strategy="top_p", value=0.6, prob_mode="softmax"), [10, 50]),
    (dict(strategy="top_p", value=0.9, prob_mode="softmax"), [10, 20, 50, 60]),
    (dict(strategy="top_p", value=0.95, prob_mode="softmax"), [10, 20, 30, 50, 60]),  # a zero group, 30 not 40
    (dict(strategy="top_p", value=0.5, prob_mode="softmax"), [10]),
    # without zeros: / 32.911 -> .6103 .8348 .9174 1.0
    (dict(strategy="top_p", value=0.9, prob_mode="softmax", include_zero=False), [10, 20, 50]),
    # smallest, no zeros: softmax(-score) over 10, 20, 50, 60 = [e^-3, e^-1, e^-2, e^-1] / .91889: .4004 (20)
    # .8007 (60) .9480 (50) 1.0 (10)
    (dict(strategy="top_p", value=0.5, prob_mode="softmax", filter_type="smallest", include_zero=False), [20, 60]),
    # min_p: largest keeps score >= value * 3; smallest keeps score <= min / value
    (dict(strategy="min_p", value=0.5), [10, 50]),
    (dict(strategy="min_p", value=0.3), [10, 20, 50, 60]),
    (dict(strategy="min_p", value=1.0), [10]),
    (dict(strategy="min_p", value=0.5, filter_type="smallest"), [30, 40]),  # min 0 -> keep the zeros
    (dict(strategy="min_p", value=0.5, filter_type="smallest", include_zero=False), [20, 50, 60]),  # <= 2
    (dict(strategy="min_p", value=0.6, filter_type="smallest", include_zero=False), [20, 60]),  # <= 1.67
]


@pytest.mark.parametrize("metric", ALL_METRICS)
@pytest.mark.parametrize(("kw", "expected"), CASES)
def test_strategy_x_metric(metric, kw, expected):
    kept, metrics = run(metric, **kw)
    assert kept == expected
    assert metrics["rollout/filter_kept_count"] == len(expected)
    assert metrics["rollout/kept_group_fraction"] == pytest.approx(len(expected) / 6)
    assert metrics["rollout/filter_zero_count"] == 2.0
    assert metrics["rollout/filter_score_mean"] == pytest.approx(7 / 6)


def test_batch_order_and_labels_do_not_matter():
    base = run("reward_variance", strategy="top_k", value=0.5, seed=0)[0]
    for seed in range(1, 6):
        assert run("reward_variance", strategy="top_k", value=0.5, seed=seed)[0] == base
    # relabel so the tie 20 / 60 flips: the lower id wins again
    kept, _ = run("reward", ids=[10, 60, 30, 40, 50, 20], strategy="top_k", value=0.5)
    assert kept == [10, 20, 50]  # 20 now labels the group scored 1.0 that was 60


def test_all_ties_keep_lowest_ids():
    assert run("reward", scores=[1.0] * 6, strategy="top_k", value=0.5)[0] == [10, 20, 30]
    assert run("reward", scores=[1.0] * 6, strategy="top_k_abs", value=2, filter_type="smallest")[0] == [10, 20]
    # uniform softmax p = 1/6: cum >= 0.4 at the third
    assert run("reward", scores=[1.0] * 6, strategy="top_p", value=0.4, prob_mode="softmax")[0] == [10, 20, 30]


def test_all_zero_variance():
    zeros = [0.0] * 6
    assert run("reward_variance", scores=zeros, strategy="top_p", value=0.9)[0] == []
    assert run("reward_variance", scores=zeros, strategy="top_p", value=1.0)[0] == IDS
    assert run("reward_variance", scores=zeros, strategy="top_p", value=1.0, include_zero=False)[0] == []
    assert run("reward_variance", scores=zeros, strategy="top_k", value=0.5)[0] == [10, 20, 30]
    for strategy, value in (("top_k", 0.5), ("top_k_abs", 2), ("min_p", 0.5), ("top_p", 0.9)):
        for mode in ("linear", "softmax"):
            kept, m = run("reward_variance", scores=zeros, strategy=strategy, value=value, include_zero=False,
                          prob_mode=mode)
            assert kept == []
            assert m["rollout/kept_group_fraction"] == 0.0
            assert m["rollout/chosen_in_group_std"] == 0.0 and m["rollout/chosen_filter_score_mean"] == 0.0


def test_group_of_one_has_zero_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0])
    gids = torch.tensor([0, 0, 1, 2])  # groups 1 and 2 hold one trajectory each
    keep, m = rf.select_groups(rewards, gids, strategy="top_p", value=1.0, include_zero=False)
    assert keep.tolist() == [True, True, False, False]
    assert m["rollout/filter_zero_count"] == 2.0


def test_selection_eps():
    # scores 3, 1 (reward metric, groups of one); value 0.8: threshold 3.2 - eps
    r, g = torch.tensor([3.0, 1.0]), torch.tensor([0, 1])
    keep = lambda eps: rf.select_groups(r, g, strategy="top_p", value=0.8, metric="reward", selection_eps=eps)[0]
    assert keep(0.0).tolist() == [True, True]  # 3 < 3.2: needs the second
    assert keep(0.5).tolist() == [True, False]  # 3 >= 2.7
    # a near-zero total: eps pushes the threshold below 0, so nothing is kept
    tiny = torch.tensor([0.004, 0.002])
    k0 = rf.select_groups(tiny, g, strategy="top_p", value=0.9, metric="reward", selection_eps=0.0)[0]
    k1 = rf.select_groups(tiny, g, strategy="top_p", value=0.9, metric="reward", selection_eps=0.01)[0]
    assert k0.tolist() == [True, True] and k1.tolist() == [False, False]


def test_linear_vs_softmax_on_small_scores():
    # scores .3 .1 .2: softmax is near uniform (.367 .301 .332), linear follows the score mass
    r, g = torch.tensor([0.3, 0.1, 0.2]), torch.tensor([0, 1, 2])
    sel = lambda mode, v: rf.select_groups(r, g, strategy="top_p", value=v, metric="reward", prob_mode=mode)[0]
    assert sel("linear", 0.8).tolist() == [True, False, True]  # 0.47: .3 -> .5
    assert sel("softmax", 0.8).tolist() == [True, True, True]  # cum .367 .699 1.0
    assert sel("softmax", 0.3).tolist() == [True, False, False]


def test_negative_scores_follow_ragen():
    r, g = torch.tensor([-1.0, -2.0]), torch.tensor([0, 1])
    # min_p largest: threshold 0.5 * -1 = -0.5, nothing reaches it
    assert not rf.select_groups(r, g, strategy="min_p", value=0.5, metric="reward")[0].any()
    # linear top_p: negative total -> threshold below 0 -> nothing
    assert not rf.select_groups(r, g, strategy="top_p", value=0.9, metric="reward")[0].any()
    assert rf.select_groups(r, g, strategy="top_k_abs", value=1, metric="reward")[0].tolist() == [True, False]


def test_metrics_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 2.0])
    gids = torch.tensor([7, 7, 8, 8, 9, 9])  # std .7071 / 0 / 1.4142, mean .5 / 1 / 1, max 1 / 1 / 2
    keep, m = rf.select_groups(rewards, gids, strategy="top_k_abs", value=1)
    assert keep.tolist() == [False, False, False, False, True, True]
    assert m["rollout/in_group_std"] == pytest.approx((math.sqrt(0.5) + math.sqrt(2)) / 3, rel=1e-6)
    assert m["rollout/chosen_in_group_std"] == pytest.approx(math.sqrt(2), rel=1e-6)
    assert m["rollout/in_group_mean"] == pytest.approx(2.5 / 3)
    assert m["rollout/chosen_in_group_mean"] == 1.0 and m["rollout/chosen_in_group_max"] == 2.0
    assert m["rollout/in_group_max"] == pytest.approx(4 / 3)
    assert m["rollout/kept_group_fraction"] == pytest.approx(1 / 3) and m["rollout/filter_zero_count"] == 1.0
    assert m["rollout/chosen_filter_score_mean"] == pytest.approx(math.sqrt(2), rel=1e-6)


def test_defaults_keep_everything():
    rewards, gids, _ = triplets("reward_variance", SCORES)
    keep, m = rf.select_groups(rewards, gids)
    assert keep.all() and m["rollout/kept_group_fraction"] == 1.0


def _reference_legacy(rewards, gids, ratio, kind):
    """StarPO-S by hand (statistics module, plain sorting): the kept group labels."""
    import statistics

    groups = {}
    for g, r in zip(gids.tolist(), rewards.tolist(), strict=True):
        groups.setdefault(g, []).append(r)
    std = {g: statistics.stdev(v) if len(v) > 1 else 0.0 for g, v in groups.items()}
    if kind == "nonzero":
        return sorted(g for g, s in std.items() if s > 1e-10)
    k = len(std) if ratio >= 1 else int(ratio * len(std) + 1e-9)
    sign = -1 if kind == "std" else 1
    return sorted(sorted(std, key=lambda g: (sign * std[g], g))[:k])


@pytest.mark.parametrize("kind", ["std", "std_rev", "nonzero"])
def test_legacy_filters_match_a_reference(kind):
    """fastpo's named filters, now presets of the family, keep what StarPO-S's rule keeps (random groups, ties)."""
    gen = torch.Generator().manual_seed(1234)
    checked = 0
    for trial in range(300):
        g = int(torch.randint(1, 40, (1,), generator=gen))
        size = int(torch.randint(1, 6, (1,), generator=gen))
        labels = torch.randperm(1000, generator=gen)[:g]
        gids = labels.repeat_interleave(size)[torch.randperm(g * size, generator=gen)]
        if trial % 2:  # binary rewards: many ties and zero-std groups
            rewards = torch.randint(0, 2, (g * size,), generator=gen).float()
        else:
            rewards = torch.randn(g * size, generator=gen)
        ratio = [0.25, 0.5, 0.29, 0.1, 1.0, float(torch.rand(1, generator=gen))][trial % 6]
        ratio = max(ratio, 1e-6)
        if kind != "nonzero" and rf.kept_group_count(g, ratio, kind) < 1:
            with pytest.raises(ValueError, match="0 groups"):
                rf.filter_groups(rewards, gids, ratio, kind)
            continue
        expected = _reference_legacy(rewards, gids, ratio, kind)
        keep, _ = rf.filter_groups(rewards, gids, ratio, kind)
        assert kept_ids(keep, gids) == expected, (trial, kind, ratio)
        got, _ = rf.select_groups(rewards, gids, **rf.legacy_filter_args(kind, ratio))
        assert torch.equal(got, keep)
        checked += 1
    assert checked > 100


def test_one_registry():
    """The named filters are presets in rollout_filter's registry; algorithms re-exports the same objects."""
    assert alg.ROLLOUT_FILTERS is rf.ROLLOUT_FILTERS and alg.filter_groups is rf.filter_groups
    assert sorted(rf.ROLLOUT_FILTERS) == ["nonzero", "std", "std_rev"]
    assert rf.kept_group_count(8, 0.25, "nonzero") is None and rf.kept_group_count(8, 0.25, "std") == 2
    with pytest.raises(ValueError, match="already registered"):
        rf.register_rollout_filter("std", strategy="top_k")
    with pytest.raises(ValueError, match="rollout_filter_strategy: unknown 'nucleus'"):
        rf.register_rollout_filter("mine", strategy="nucleus")


def test_max_groups_caps_by_group_id():
    rewards, gids, _ = triplets("reward_variance", SCORES)
    keep, m = rf.select_groups(rewards, gids, strategy="top_p", value=1.0, include_zero=False, max_groups=2)
    assert kept_ids(keep, gids) == [10, 20]  # of 10, 20, 50, 60: the two lowest ids
    assert m["rollout/filter_kept_count"] == 2.0  # the metrics describe the capped set: stds 3 and 1
    assert m["rollout/chosen_in_group_std"] == pytest.approx(2.0) and m["rollout/kept_group_fraction"] == 2 / 6
    with pytest.raises(ValueError, match="max_groups must be None or an int >= 1, got 0"):
        rf.select_groups(rewards, gids, max_groups=0)


def test_legacy_args():
    assert rf.legacy_filter_args("std", 0.25) == {"value": 0.25, "strategy": "top_k", "filter_type": "largest",
                                                   "include_zero": True, "metric": "reward_variance"}
    with pytest.raises(ValueError, match="unknown legacy filter 'max'"):
        rf.legacy_filter_args("max", 0.25)
    with pytest.raises(ValueError, match=r"rollout_filter_ratio must lie in \(0, 1\], got 0"):
        rf.legacy_filter_args("std", 0)


R, G = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
BAD = [
    (dict(strategy="nucleus"), "rollout_filter_strategy: unknown 'nucleus'"),
    (dict(metric="variance"), "rollout_filter_metric: unknown 'variance'"),
    (dict(filter_type="max"), "rollout_filter_type: unknown 'max'"),
    (dict(prob_mode="exp"), "rollout_filter_top_p_prob_mode: unknown 'exp'"),
    (dict(selection_eps=-0.1), "rollout_filter_selection_eps must be a finite number >= 0, got -0.1"),
    (dict(selection_eps=float("nan")), "rollout_filter_selection_eps must be a finite number >= 0, got nan"),
    (dict(include_zero=1), "rollout_filter_include_zero must be a bool, got 1"),
    (dict(value=float("inf")), "rollout_filter_value must be a finite number, got inf"),
    (dict(value=0.0), r"rollout_filter_value for top_p must lie in \(0, 1\], got 0.0"),
    (dict(strategy="top_k", value=1.5), r"rollout_filter_value for top_k must lie in \(0, 1\], got 1.5"),
    (dict(strategy="min_p", value=-1), r"rollout_filter_value for min_p must lie in \(0, 1\], got -1"),
    (dict(strategy="top_k_abs", value=2.5), "a whole number >= 1, got 2.5"),
    (dict(strategy="top_k_abs", value=0), "a whole number >= 1, got 0"),
    (dict(metric="entropy"), r"rollout_filter_metric='entropy' needs entropies \(fp32 \[B\]\); got None"),
    (dict(metric="length", lengths=torch.tensor([1.0])), r"lengths must be a finite floating tensor of shape \(2,\)"),
    (dict(metric="entropy_std", entropies=torch.tensor([1.0, float("nan")])), "with non-finite entries"),
]


@pytest.mark.parametrize(("kw", "msg"), BAD)
def test_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        rf.select_groups(R, G, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("rewards", "gids", "msg"), [
    (torch.zeros(0), torch.zeros(0, dtype=torch.int64), r"rewards must be a non-empty \[B\] tensor, got shape \(0,\)"),
    (torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int64), r"got shape \(2, 2\)"),
    (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), "rewards must be a finite floating tensor"),
    (torch.tensor([1, 0]), torch.tensor([0, 0]), "rewards must be a finite floating tensor"),
    (torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), "group_ids must be an integer tensor of shape"),
    (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), "group_ids must be an integer tensor of shape"),
])
def test_bad_tensors(rewards, gids, msg):
    with pytest.raises(ValueError, match=msg) as e:
        rf.select_groups(rewards, gids)
    assert "\n" not in str(e.value)


def test_registries_reject_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        rf.register_filter_metric("reward")(lambda v, g: v)
    with pytest.raises(ValueError, match="already registered"):
        rf.register_filter_metric("reward_std")(lambda v, g: v)
    with pytest.raises(ValueError, match="already registered"):
        rf.register_filter_strategy("top_p")(lambda s, **k: s > 0)
    with pytest.raises(ValueError, match="reads='tokens'"):
        rf.register_filter_metric("x", reads="tokens")


def test_check_filter_args_resolves_aliases():
    assert rf.check_filter_args("top_p", 1.0, "reward_std") == "reward_variance"
    assert rf.check_filter_args("top_k_abs", 4.0, "entropy_std") == "entropy_variance"


def test_empty_stop():
    stop = rf.EmptyStop(steps=3)
    assert [stop.update(k) for k in (False, False, True, False, False)] == [False] * 5
    assert stop.count == 2
    assert stop.update(False) is True and stop.count == 3
    assert stop.update(False) is True  # stays True until a kept step resets it
    assert stop.update(True) is False and stop.count == 0
    off = rf.EmptyStop(steps=0)
    assert not any(off.update(False) for _ in range(50)) and off.count == 50
    assert rf.EmptyStop().steps == 5  # RAGEN's base.yaml default
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="rollout_filter_empty_stop_steps must be an int >= 0"):
            rf.EmptyStop(steps=bad)


def test_filter_loss_scale():
    assert rf.filter_loss_scale(0.25, "none") == 1.0
    assert rf.filter_loss_scale(0.25, "linear") == 0.25
    assert rf.filter_loss_scale(0.25, "sqrt") == 0.5
    assert rf.filter_loss_scale(0.0, "sqrt") == 0.0 and rf.filter_loss_scale(1.0, "linear") == 1.0
    with pytest.raises(ValueError, match="filter_loss_scaling: unknown 'log'"):
        rf.filter_loss_scale(0.5, "log")
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"kept_fraction must lie in \[0, 1\]"):
            rf.filter_loss_scale(bad, "linear")


def test_min_p_absolute_slack():
    g = torch.tensor([0, 1])
    # largest: 4.45e-9 >= 0.9 * 5e-9 - 1e-10 = 4.4e-9; smallest: 2.05e-9 <= 1e-9 / 0.5 + 1e-10
    big = rf.select_groups(torch.tensor([5e-9, 4.45e-9]), g, strategy="min_p", value=0.9, metric="reward")[0]
    small = rf.select_groups(torch.tensor([1e-9, 2.05e-9]), g, strategy="min_p", value=0.5, metric="reward",
                             filter_type="smallest")[0]
    assert big.tolist() == [True, True] and small.tolist() == [True, True]


def test_top_k_count_rounding():
    rewards = torch.arange(100, dtype=torch.float32)
    keep, m = rf.select_groups(rewards, torch.arange(100), strategy="top_k", value=0.29, metric="reward")
    assert keep.nonzero().squeeze(-1).tolist() == list(range(71, 100))  # 29 groups, not int(28.999...) = 28
    assert m["rollout/filter_kept_count"] == 29.0


class _Draws:
    """A stand-in for numpy's Generator: choice returns the given positions (to check adjust_batch's arithmetic
    by hand)."""

    def __init__(self, picks):
        self.picks, self.calls = picks, []

    def choice(self, n, size, replace):
        import numpy as np

        self.calls.append((n, size, replace))
        return np.array(self.picks[:size])


def test_adjust_batch_by_hand():
    kept = [3, 4, 5, 9, 10, 11, 20]  # 7 kept, divisor 4: remainder 3
    rng = _Draws([6, 0, 2])
    assert rf.adjust_batch(kept, 4, "copy", rng) == kept + [20]  # 4 - 3 = 1 copy: position 6
    assert rng.calls == [(7, 1, False)]
    rng = _Draws([6, 0, 2])
    assert rf.adjust_batch(kept, 4, "delete", rng) == [4, 9, 10, 11]  # drop positions 6, 0, 2
    assert rng.calls == [(7, 3, False)]
    rng = _Draws([0, 1, 0, 1, 0, 1, 0])
    assert rf.adjust_batch([7, 8], 9, "copy", rng) == [7, 8, 7, 8, 7, 8, 7, 8, 7]  # 7 copies of 2: replacement
    assert rng.calls == [(2, 7, True)]
    assert rf.adjust_batch([7, 8], 9, "delete", _Draws([1, 0])) == []  # fewer than the divisor: all dropped
    for mode in ("none", "copy", "delete"):
        assert rf.adjust_batch(kept[:4], 4, mode, _Draws([])) == kept[:4]  # divisible (or none): unchanged
    assert rf.adjust_batch([], 4, "copy", _Draws([])) == []


def test_adjust_batch_with_numpy_draws():
    import numpy as np

    for mode, size in (("copy", 8), ("delete", 4)):
        out = rf.adjust_batch(list(range(6)), 4, mode, np.random.default_rng(0))
        assert len(out) == size and set(out) <= set(range(6))
        assert out == rf.adjust_batch(list(range(6)), 4, mode, np.random.default_rng(0))  # seeded: reproducible
    with pytest.raises(ValueError, match=r"batch_adjust_mode: unknown 'pad'; choose from \['none', 'copy', 'delete'\]"):
        rf.adjust_batch([1], 2, "pad", np.random.default_rng(0))
    with pytest.raises(ValueError, match="divisor must be an int >= 1, got 0"):
        rf.adjust_batch([1], 0, "copy", np.random.default_rng(0))
