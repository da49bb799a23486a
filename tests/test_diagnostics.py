"""fastpo.diagnostics: RAGEN-2's collapse metrics against hand-computed values, the samplers, the schedule, the
config checks, RAGEN's names, and one trainer iteration with them on."""

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastpo import diagnostics as D
from fastpo.config import Config, ConfigError
from fastpo.config_load import parse_args
from fastpo.metrics import ragen_metric_name
from fastpo.preflight import validate


def _logmeanexp(*xs: float) -> float:
    return math.log(sum(math.exp(x) for x in xs) / len(xs))


def _pstd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def test_think_text_is_the_first_thought_cleaned():
    assert D.think_text("<think> go left </think><answer>Left</answer>") == "go left"
    assert D.think_text("pre <think>a<answer>b</think> x </think>") == "ab"  # specials deleted, first close
    assert D.think_text("<answer>Left</answer>") == "" and D.think_text("<think>never closed") == ""
    assert D.think_text("</think><think>x</think>") == "x"
    assert D.think_text("<think>" * 20000) == ""  # linear, not a quadratic regex scan


def test_schedule_is_iteration_one_then_every_nth():
    due = [s for s in range(0, 13) if D.collapse_due(SimpleNamespace(collapse_every=5), s)]
    assert due == [1, 5, 10]
    assert not any(D.collapse_due(SimpleNamespace(collapse_every=0), s) for s in range(1, 20))


def test_pair_metrics_match_hand_computed_values():
    # 3 thoughts x 2 prompts; thoughts 0 and 2 belong to prompt 0, thought 1 to prompt 1; 2, 1, 4 tokens
    mean = [[-1.0, -3.0], [-2.0, -0.5], [-1.0, -1.5]]
    counts = [2, 1, 4]
    total = [[v * c for v in row] for row, c in zip(mean, counts, strict=True)]
    cols = [0, 1, 0]
    m = D.pair_metrics(torch.tensor(mean, dtype=torch.float64), torch.tensor(total, dtype=torch.float64),
                       torch.tensor(cols), ["x0", "x1"])
    matched = [-1.0, -0.5, -1.0]
    marginal = [_logmeanexp(*row) for row in mean]
    matched_sum = [-2.0, -0.5, -4.0]
    marginal_sum = [_logmeanexp(*row) for row in total]
    mi = sum(matched) / 3 - sum(marginal) / 3
    assert m["mi_estimate"] == pytest.approx(mi, abs=1e-12)
    assert m["mi_upper_bound"] == pytest.approx(math.log(2))
    assert m["matched_log_prob_mean"] == pytest.approx(-2.5 / 3)
    assert m["conditional_entropy_est"] == pytest.approx(2.5 / 3)
    assert m["reasoning_entropy_est"] == pytest.approx(-sum(marginal) / 3)
    assert m["mi_seq_estimate"] == pytest.approx(sum(a - b for a, b in zip(matched_sum, marginal_sum, strict=True)) / 3)
    assert m["conditional_entropy_seq_est"] == pytest.approx(6.5 / 3)
    assert m["marginal_std"] == pytest.approx(_pstd(marginal))
    assert m["marginal_std_seq"] == pytest.approx(_pstd(marginal_sum))
    z = sum((a - b) / (_pstd(marginal) + 1e-3) for a, b in zip(matched, marginal, strict=True)) / 3
    assert m["mi_zscore"] == pytest.approx(z)
    assert m["retrieval_accuracy"] == 1.0 and m["retrieval_chance_level"] == 0.5  # every argmax is the own prompt
    assert m["retrieval_accuracy@2"] == 1.0 and m["retrieval_chance_level@2"] == 1.0  # k capped at N = 2


def test_retrieval_counts_equal_prompts_as_one_answer():
    cross = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-3.0, -2.0, -1.0]], dtype=torch.float64)
    cols = torch.tensor([0, 1, 1])
    m = D.retrieval_metrics(cross, cols, ["p", "q", "r"])
    # argmax 0, 0, 2 against 0, 1, 1: one hit; top-2 {0,1}, {0,1}, {2,1}: three
    assert m["retrieval_accuracy"] == pytest.approx(1 / 3) and m["retrieval_chance_level"] == pytest.approx(1 / 3)
    assert m["retrieval_accuracy@2"] == 1.0 and m["retrieval_chance_level@2"] == pytest.approx(2 / 3)
    assert m["retrieval_above_chance@2"] == pytest.approx(1 / 3)
    assert m["retrieval_chance_level@4"] == 1.0 and m["retrieval_accuracy@8"] == 1.0  # k capped at N = 3
    same = D.retrieval_metrics(cross, cols, ["p", "q", "p"])  # columns 0 and 2 hold one prompt
    # thought 2 (prompt q) picks column 2 = p: still wrong; chance = mean(2/3, 1/3, 1/3)
    assert same["retrieval_accuracy"] == pytest.approx(1 / 3)
    assert same["retrieval_chance_level"] == pytest.approx(4 / 9)
    assert D.retrieval_metrics(cross, cols, ["p", "p", "p"])["retrieval_accuracy"] == 1.0


def test_samplers():
    a, b, none = ([1], [5]), ([2], [6, 7]), ([3], [])
    pairs = [[a, b], [none], [b, none, a]]
    first, groups = D.first_turn_sample(pairs, [10, 11, 12], 0, np.random.default_rng(0))
    assert first == [a, b] and groups == [10, 12]  # trajectory 1's first turn has no thought
    first, groups = D.first_turn_sample(pairs, [10, 11, 12], 1, np.random.default_rng(0))
    assert len(first) == 1 and groups[0] in (10, 12)
    draws = D.trajectory_uniform_sample(pairs, 0, np.random.default_rng(1))
    assert len(draws) <= 4 and all(p in (a, b) for p in draws)  # 4 valid turns; draws on trajectory 1 yield none
    many = D.trajectory_uniform_sample([[a], [b, b, b]] * 1, 2000, np.random.default_rng(2))
    assert len(many) == 4  # capped at the valid turns
    # P(m, t) = 1/M x 1/T_m: trajectory 0's one turn is drawn about half the time, not a quarter
    big = D.trajectory_uniform_sample([[a]] + [[b, b, b]], 0, np.random.default_rng(3))
    counts = [sum(p == a for p in D.trajectory_uniform_sample([[a]] * 50 + [[b] * 3] * 50, 0,
                                                                np.random.default_rng(s))) for s in range(20)]
    assert len(big) == 4 and 0.4 < sum(counts) / (20 * 200) < 0.6


@pytest.fixture(scope="module")
def tokenizer():
    from fastpo.model import load_tokenizer
    from fastpo.tiny_agent import tiny_agent_path

    return load_tokenizer(tiny_agent_path())


def _traj(state: str, *thoughts: str, group: int):
    messages = [{"role": "system", "content": "You play a game."}, {"role": "user", "content": f"State {state}"}]
    for k, thought in enumerate(thoughts):
        if k:
            messages.append({"role": "user", "content": f"Reward:\n0\n\nTurn {k + 1}:\nState {state}{k}"})
        messages.append({"role": "assistant", "content": f"<think>{thought}</think><answer>Left</answer>"})
    return SimpleNamespace(messages=messages, group=group)


def _fake_actor(owner: dict):
    """Scores a thought -1 per token after its own prompt, -3 per token after any other."""
    calls = []

    def score(seqs):
        calls.append(len(seqs))
        out = []
        for ids, mask, _group in seqs:
            prompt, thought = tuple(ids[~mask].tolist()), tuple(ids[mask].tolist())
            out.append((-1.0 if owner[thought] == prompt else -3.0) * len(thought))
        return out
    return score, calls


def test_detector_first_turn_metrics_by_hand(tokenizer):
    cfg = validate(parse_args(["--trainer.collapse_every", "1", "--trainer.collapse_multi_turn", "false"]))
    trajs = [_traj("A", "go left now", group=0), _traj("A", "left again", group=0),
             _traj("B", "go up", group=1), _traj("B", "<answer>", group=1)]  # the last has an empty thought
    owner = {}
    for t in trajs:
        for prompt, thought in D.turn_pairs(t, tokenizer):
            owner[tuple(thought)] = tuple(prompt)
    prompt_a, thought_a = D.turn_pairs(trajs[0], tokenizer)[0]
    assert tokenizer.decode(prompt_a).endswith("<think>") and tokenizer.decode(thought_a) == "go left now"
    score, calls = _fake_actor(owner)
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    m = D.CollapseDetector(cfg)(trajs, tokenizer, score, step=1)
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()
    assert torch.equal(torch.get_rng_state(), state[2])  # the training's RNG streams are untouched
    assert calls == [3 * 2]  # 3 valid thoughts x 2 prompts (groups), one collective call
    assert m["collapse/first_turn_num_total"] == 4 and m["collapse/first_turn_num_valid"] == 3
    assert m["collapse/first_turn_valid_rate"] == 0.75
    marginal = _logmeanexp(-1.0, -3.0)  # per token, the same for every thought
    assert m["collapse/first_turn/mi_estimate"] == pytest.approx(-1.0 - marginal)
    assert m["collapse/first_turn/mi_upper_bound"] == pytest.approx(math.log(2))
    assert m["collapse/first_turn/marginal_std"] == pytest.approx(0.0, abs=1e-12)
    assert m["collapse/first_turn/mi_zscore"] == pytest.approx((-1.0 - marginal) / 1e-3)
    assert m["collapse/first_turn/retrieval_accuracy"] == 1.0
    assert m["collapse/first_turn/marginal_std_ema"] == pytest.approx(0.0, abs=1e-12)
    assert not any(k.startswith("collapse/multi_turn") for k in m)


def test_detector_multi_turn_and_the_running_std(tokenizer):
    cfg = validate(parse_args(["--trainer.collapse_every", "2", "--trainer.collapse_first_turn", "false",
                               "--trainer.collapse_num_samples", "0"]))
    trajs = [_traj("A", "one", "two words", group=0), _traj("B", "three", "", group=1)]
    owner = {}
    for t in trajs:
        for prompt, thought in D.turn_pairs(t, tokenizer):
            owner[tuple(thought)] = tuple(prompt)
    detector = D.CollapseDetector(cfg)
    score, _ = _fake_actor(owner)
    m = detector(trajs, tokenizer, score, step=2)
    assert m["collapse/valid_thinking_rate"] == 0.75  # 3 of 4 turns think
    n = m["collapse/multi_turn/mi_upper_bound"]
    assert 1 <= round(math.exp(n)) <= 3  # the draws: at most the 3 valid turns
    first = m["collapse/multi_turn/marginal_std"]
    assert m["collapse/multi_turn/marginal_std_ema"] == pytest.approx(first)
    m2 = detector(trajs, tokenizer, score, step=4)
    assert m2["collapse/multi_turn/marginal_std_ema"] == pytest.approx(0.9 * first + 0.1 * m2[
        "collapse/multi_turn/marginal_std"])


def test_ragen_names():
    assert ragen_metric_name("collapse/first_turn/mi_estimate") == "collapse_first_turn_sample/mi_estimate"
    assert ragen_metric_name("collapse/multi_turn/retrieval_accuracy@2") == \
        "collapse_trajectory_sample/retrieval_accuracy@2"
    assert ragen_metric_name("collapse/first_turn_valid_rate") == "collapse/first_turn_valid_rate"
    assert ragen_metric_name("timing/collapse") == "timing_s/collapse_metrics"
    assert ragen_metric_name("timing/collapse_first_turn") == "timing_s/collapse_first_turn_step"


# alike in shape to test_env_mix's bound tests only: each file lists its own flags and messages
@pytest.mark.parametrize("args, line", [
    (["--trainer.collapse_every", "-1"], "trainer.collapse_every must be >= 0 (0 = off), got -1"),
    (["--trainer.collapse_num_samples", "-2"], "trainer.collapse_num_samples must be >= 0 (0 = all), got -2"),
    (["--trainer.collapse_every", "5", "--rollout.enable_think", "false"],
     "trainer.collapse_every=5 needs rollout.enable_think=true"),
    (["--trainer.collapse_every", "5", "--rollout.max_context_window", "2"],
     "trainer.collapse_every=5 needs rollout.max_context_window -1 (full context), got 2"),
    (["--trainer.collapse_every", "5", "--trainer.collapse_first_turn", "false", "--trainer.collapse_multi_turn",
      "false"], "trainer.collapse_every=5 needs trainer.collapse_first_turn or trainer.collapse_multi_turn true"),
])
def test_bad_settings_are_one_config_line(args, line):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(args))
    assert line in str(err.value)


def test_group_rv_rows_by_hand():
    rows = D.group_rv_rows([1.0, 0.0, 0.5, 0.5, 2.0], [7, 7, 3, 3, 9], [True, True, False, False, False])
    assert rows == [{"group_id": 7, "reward_std": pytest.approx(math.sqrt(0.5)), "selected": True},
                    {"group_id": 3, "reward_std": 0.0, "selected": False},
                    {"group_id": 9, "reward_std": 0.0, "selected": False}]  # a group of one: 0


def test_group_rv_table_goes_to_jsonl_and_one_growing_wandb_table(tmp_path, monkeypatch):
    import io
    import sys
    import types

    from fastpo.metrics import MetricsLogger

    logged = []
    mod = types.ModuleType("wandb")
    mod.__spec__ = __import__("importlib.machinery").machinery.ModuleSpec("wandb", None)
    mod.init = lambda **kw: SimpleNamespace(log=lambda data, step: logged.append((step, data)), finish=lambda: None)
    mod.Table = lambda columns, data: SimpleNamespace(columns=columns, data=data)
    monkeypatch.setitem(sys.modules, "wandb", mod)
    logger = MetricsLogger(tmp_path, 0, wandb=True, stream=io.StringIO())
    logger.log_group_rv(1, [{"group_id": 4, "reward_std": 0.5, "selected": True}])
    logger.log_group_rv(2, [{"group_id": 4, "reward_std": 0.0, "selected": False},
                            {"group_id": 5, "reward_std": 1.0, "selected": True}])
    lines = [json.loads(x) for x in (tmp_path / "group_rv.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "group_id": 4, "reward_std": 0.5, "selected": True},
                     {"step": 2, "group_id": 4, "reward_std": 0.0, "selected": False},
                     {"step": 2, "group_id": 5, "reward_std": 1.0, "selected": True}]
    (step, data), = [e for e in logged if e[0] == 2]
    table = data["rollout/group_rv_table"]
    assert table.columns == ["step", "group_id", "reward_std", "selected"] and len(table.data) == 3
    logger.truncate_after(1)  # a run resumed at step 1 drops the replayed steps' rows
    assert len((tmp_path / "group_rv.jsonl").read_text().splitlines()) == 1
    logger.close()
    MetricsLogger(tmp_path / "other", 1).log_group_rv(1, [{"group_id": 1, "reward_std": 0.0, "selected": True}])
    assert not (tmp_path / "other" / "group_rv.jsonl").exists()  # rank 0 only


def test_off_by_default():
    assert Config().trainer.collapse_every == 0 and not Config().trainer.log_group_rv_table


@pytest.mark.slow
def test_the_trainer_scores_thoughts_with_its_actor(tmp_path, tokenizer):
    """Trainer._sequence_logps (the detector's scorer) is the actor's summed logprob of the masked tokens, at the
    sampling temperature; the detector on it gives finite metrics within their bounds; an iteration logs them."""
    from fastpo.trainer import Trainer

    cfg = validate(parse_args(["--preset", "tiny", "--rollout.enable_think", "true", "--trainer.collapse_every", "1",
                               "--env.max_turns", "2", "--rollout.response_length", "16", "--env.env_groups", "2",
                               "--env.group_size", "2", "--optim.mini_batch_size", "2",
                               "--trainer.log_group_rv_table", "true", "--trainer.run_dir", str(tmp_path / "run")]), 1)
    trainer = Trainer(cfg)
    try:
        ids = np.asarray(tokenizer.encode("You play. State A <think> go left now", add_special_tokens=False))
        mask = np.zeros(len(ids), dtype=bool)
        mask[-4:] = True
        (got,) = trainer._sequence_logps([(ids, mask, 0)])
        with torch.no_grad():
            logits = trainer.actor(torch.as_tensor(ids)[None]).logits[0].double() / cfg.rollout.temperature
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.as_tensor(ids[1:])[:, None])[:, 0]
        assert got == pytest.approx(float(logp[torch.as_tensor(mask[1:])].sum()), rel=1e-4)
        trajs = [_traj("A", "go left now", group=0), _traj("A", "left", group=0), _traj("B", "up up", group=1),
                 _traj("B", "down", group=1)]
        m = D.CollapseDetector(cfg)(trajs, tokenizer, trainer._sequence_logps, step=1)
        for kind in ("first_turn", "multi_turn"):
            mi, bound = m[f"collapse/{kind}/mi_estimate"], m[f"collapse/{kind}/mi_upper_bound"]
            assert math.isfinite(mi) and mi <= bound + 1e-9  # log p(z|x) - log mean_j p(z|x_j) <= log N
        trainer.step = 1
        row = trainer.iteration()
        assert row["collapse/first_turn_num_total"] == 4 and "collapse/valid_thinking_rate" in row
        assert "timing/collapse" in trainer.timer.pop()
        rv = (tmp_path / "run" / "group_rv.jsonl").read_text().splitlines()
        assert len(rv) == 2 and all(json.loads(x)["step"] == 1 for x in rv)  # one row per group
    finally:
        trainer.close(export=False)


# ------------------------------------------------------------------------------------------ gradient analysis
def test_gradient_analysis_schedule():
    due = [s for s in range(0, 12) if D.gradient_analysis_due(SimpleNamespace(gradient_analysis_every=5), s)]
    assert due == [1, 6, 11]
    assert not any(D.gradient_analysis_due(SimpleNamespace(gradient_analysis_every=0), s) for s in range(1, 9))


def test_rv_buckets_by_hand():
    std = [0.5, 0.1, 2.5, 0.1, 7.0]
    q = D.rv_buckets(std, 2, "quantile")  # sorted: 1, 3 (tie: given order), 0, 2, 4; 5 // 2 = 2, remainder last
    assert q == {"all": [0, 1, 2, 3, 4], "bucket_1": [1, 3], "bucket_2": [0, 2, 4]}
    assert D.rv_buckets(std, 9, "quantile") == {"all": [0, 1, 2, 3, 4], "bucket_1": [1], "bucket_2": [3],
                                                "bucket_3": [0], "bucket_4": [2], "bucket_5": [4]}
    f = D.rv_buckets(std, 6, "fixed_rv")
    assert f == {"all": [0, 1, 2, 3, 4], "bucket_1": [0, 1, 3], "bucket_2": [], "bucket_3": [2], "bucket_4": [],
                 "bucket_5": [], "bucket_6": [4]}
    with pytest.raises(ValueError, match="bucket mode must be one of"):
        D.rv_buckets(std, 2, "median")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_loss_terms_add_up_to_the_actor_loss(mode, kl_type):
    """task + entropy + kl is algorithms.policy_loss's loss, and their gradients add up to its gradient."""
    import dataclasses

    from fastpo import algorithms
    from fastpo.objectives import actor_loss_components

    a = dataclasses.replace(Config().algorithm, entropy_coef=0.01, kl_coef=0.05, kl_type=kl_type, loss_agg_mode=mode)
    g = torch.Generator().manual_seed(0)
    n, cu = 20, torch.tensor([0, 7, 20])
    base = torch.randn(n, generator=g) - 1
    old, adv = base + 0.1 * torch.randn(n, generator=g), torch.randn(n, generator=g)
    ref, mask = base + 0.2 * torch.randn(n, generator=g), torch.rand(n, generator=g) > 0.3
    ent0 = torch.rand(n, generator=g)
    grads = []
    for split in (False, True):
        logp, ent = base.clone().requires_grad_(), ent0.clone().requires_grad_()
        if split:
            terms = actor_loss_components(logp, ent, old, adv, mask, ref, a, cu_seqlens=cu, norm_len=15.0)
            assert sorted(terms) == ["entropy", "kl", "task"]
            loss = sum(terms.values())
        else:
            loss = algorithms.policy_loss(logp, old, adv, mask, ent, ref, a, cu_seqlens=cu, norm_len=15.0)[0]
        loss.backward()
        grads.append((float(loss.detach()), logp.grad, ent.grad))
    assert grads[1][0] == pytest.approx(grads[0][0], abs=1e-6)
    assert torch.allclose(grads[1][1], grads[0][1], atol=1e-7) and torch.allclose(grads[1][2], grads[0][2], atol=1e-7)
    no_extras = actor_loss_components(base, ent0, old, adv, mask, None, dataclasses.replace(a, entropy_coef=0.0),
                                      cu_seqlens=cu, norm_len=15.0)
    assert sorted(no_extras) == ["task"]


@pytest.mark.parametrize("args, line", [
    (["--trainer.gradient_analysis_every", "-1"], "trainer.gradient_analysis_every must be >= 0 (0 = off), got -1"),
    (["--trainer.gradient_analysis_num_buckets", "0"], "trainer.gradient_analysis_num_buckets must be >= 1, got 0"),
    (["--trainer.gradient_analysis_every", "2", "--algorithm.offpolicy_correction", "tis",
      "--algorithm.old_logprobs", "trainer", "--rollout.train_on_observations", "false"],
     "trainer.gradient_analysis_every=2 needs algorithm.offpolicy_correction none"),
])
def test_bad_gradient_analysis_settings_are_one_config_line(args, line):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(args))
    assert line in str(err.value)


_ONE_MINI_BATCH = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16",
                   "--env.env_groups", "2", "--env.group_size", "2", "--optim.mini_batch_size", "2",
                   "--algorithm.entropy_coef", "0", "--algorithm.kl_coef", "0", "--optim.ppo_epochs", "1"]


@pytest.mark.slow
def test_gradient_analysis_measures_the_update_s_gradient_and_leaves_training_alone(tmp_path):
    """One kept group, one mini-batch, no entropy / KL term: the analysis's task-gradient norm over "all" is the
    norm the update's one optimiser step then measures at the same weights; and an iteration with the analysis
    trains exactly as one without it."""
    from test_trainer import train_iterations

    on = validate(parse_args([*_ONE_MINI_BATCH, "--trainer.gradient_analysis_every", "1",
                              "--trainer.run_dir", str(tmp_path / "on")]), 1)
    off = validate(parse_args([*_ONE_MINI_BATCH, "--trainer.run_dir", str(tmp_path / "off")]), 1)
    rows_on, weights_on = train_iterations(on, 1)
    rows_off, weights_off = train_iterations(off, 1)
    m = rows_on[0]
    assert m["grad_norm/all/sample_count"] == 2 and m["grad_norm/all/sample_pct"] == 1.0
    assert m["grad_norm/all/task"] == pytest.approx(m["actor/grad_norm"], rel=1e-5)
    assert m["actor/grad_norm/task"] == m["grad_norm/all/task"] and "grad_norm/all/entropy" not in m
    assert m["grad_norm/bucket_1/sample_count"] == 2  # one group: one bucket
    assert m["grad_norm/all/loss/policy"] == pytest.approx(m["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert "grad_norm/all/task" not in rows_off[0]
    assert all(torch.equal(weights_on[k], weights_off[k]) for k in weights_off)
