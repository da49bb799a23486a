"""RAGEN's configs in three versions port without --ignore: the paper-time files (April 2025), the September-2025
files and RAGEN-2's (April 2026). The settings are test data (tests/ragen_settings.py, each version's source
repository and commit in its SOURCES); every key is mapped, listed as inert, or noted as not ported, and a value
fastpo cannot honour is refused in one line naming the key, the value and the accepted values. The slow test ports
each experiment from the command line and trains it 2 iterations with the tiny agent at small sizes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ragen_settings as S
import yaml
from test_trainer import _main

from fastpo import ragen_config as rc
from fastpo.config import Config, ConfigError
from fastpo.config_load import merge
from fastpo.preflight import validate

VERSIONS = ("paper", "sept", "today")
EXPERIMENTS = ("_1_bandit", "_2_sokoban", "_3_frozen_lake")


def nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = copy.deepcopy(value)
    return out


def ragen(version: str, experiment: str) -> dict:
    """The merged RAGEN config of one experiment, rebuilt from the test data."""
    up = version.upper()
    cfg = nested({**getattr(S, f"COMMON_{up}"), **getattr(S, f"EXPERIMENTS_{up}")[experiment]})
    cfg["custom_envs"] = copy.deepcopy(getattr(S, f"CUSTOM_ENVS_{up}")[experiment])
    return cfg


def test_sources_are_named():
    assert set(S.SOURCES) == set(VERSIONS)
    for repo, commit, _ in S.SOURCES.values():
        assert repo.endswith("/RAGEN") and len(commit) == 40


def _validate_errors(out: dict) -> list[str]:
    cfg = merge(Config(), out)
    cfg.trainer.log_wandb = False  # W&B is not installed here; the mapping itself is checked in the tests
    try:
        validate(cfg)
    except ConfigError as err:
        return [line.strip() for line in str(err).splitlines()[1:]]
    return []


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_ports_without_ignore(version, experiment):
    out, notes = rc.port(ragen(version, experiment))
    assert _validate_errors(out) == []  # every remaining check of fastpo's config passes
    alg, env, model, rollout = out["algorithm"], out["env"], out["model"], out["rollout"]
    assert alg["adv_estimator"] == "gae" and alg["eps_high"] == 0.28 and model["lora_rank"] == 0
    assert env["env_groups"] == 8 and env["group_size"] == 16
    assert rollout["train_on_observations"] is (version == "paper")  # enable_response_mask False in April 2025
    if version == "today":
        assert (alg["rollout_filter_strategy"], alg["rollout_filter_value"], alg["rollout_filter_direction"]) == (
            "top_p", 1.0, "largest")
        assert alg["rollout_filter_empty_stop_steps"] == 5 and alg["batch_adjust_mode"] == "copy"
        assert (alg["zero_task_advantage"], alg["soft_advantage_reweight"], alg["norm_adv_by_std"]) == (
            False, False, True)
        t = out["trainer"]  # RAGEN-2's diagnostics and checkpoint count
        assert (t["collapse_every"], t["collapse_first_turn"], t["collapse_num_samples"]) == (5, True, 64)
        assert (t["keep_checkpoints"], t["gradient_analysis_every"], t["log_group_rv_table"]) == (1, 0, False)
    else:
        assert (alg["rollout_filter_type"], alg["rollout_filter_ratio"]) == ("std", 0.25)
    if version == "paper":
        assert any(n.startswith("lora.rank=64: no effect (lora.enabled is false") for n in notes)
    if (version, experiment) == ("today", "_2_sokoban"):
        entry = env["train"][0]
        assert entry["label"] == "CoordSokoban" and entry["kwargs"]["observation_format"] == "grid_coord"
        assert entry["prompt"]["max_tokens"] == 120 and "zero-indexed coordinates" in entry["prompt"]["env_instruction"]
    if (version, experiment) == ("today", "_3_frozen_lake"):
        assert env["train"][0]["kwargs"]["success_rate"] == S.CUSTOM_ENVS_TODAY[experiment]["CoordFrozenLake"][
            "env_config"]["success_rate"]
    if (version, experiment) == ("today", "_1_bandit"):
        assert [e["kwargs"]["split"] for e in env["val"]] == ["train", "test"]


@pytest.mark.parametrize("mode", ["full", "limited_multi_turn", "single_turn"])
def test_context_window_mode_ports_with_ragen2_s_reading_of_the_other_keys(mode):
    """RAGEN-2's modes: full ignores max_context_window; the per-turn modes ignore use_turn_scores and
    enable_response_mask (and RAGEN-2 computes no collapse metrics there). The port follows, with a note each."""
    settings = {**S.COMMON_TODAY, **S.EXPERIMENTS_TODAY["_2_sokoban"], "agent_proxy.context_window_mode": mode,
                "agent_proxy.max_context_window": 3, "agent_proxy.use_turn_scores": True,
                "enable_response_mask": False}
    cfg = nested(settings)
    cfg["custom_envs"] = copy.deepcopy(S.CUSTOM_ENVS_TODAY["_2_sokoban"])
    out, notes = rc.port(cfg)
    r = out["rollout"]
    assert r["context_window_mode"] == mode
    if mode == "full":
        assert r["max_context_window"] == -1 and (r["reward_level"], r["train_on_observations"]) == ("turn", True)
        assert any(n.startswith("agent_proxy.max_context_window=3: no effect with context_window_mode full")
                   for n in notes)
        assert out["trainer"]["collapse_every"] == 5
    else:
        assert r["max_context_window"] == 3 and (r["reward_level"], r["train_on_observations"]) == ("trajectory",
                                                                                                   False)
        assert any(n.startswith(f"agent_proxy.use_turn_scores=True: no effect with context_window_mode {mode}")
                   for n in notes)
        assert any(n.startswith(f"enable_response_mask=False: no effect with context_window_mode {mode}")
                   for n in notes)
        assert out["trainer"]["collapse_every"] == 0
        assert _validate_errors(out) == []


@pytest.mark.parametrize("key,value,message", [
    ("agent_proxy.context_window_mode", "sliding",
     "agent_proxy.context_window_mode='sliding': accepted: full, limited_multi_turn, single_turn"),
    ("agent_proxy.batch_adjust_mode", "pad", "agent_proxy.batch_adjust_mode='pad': accepted: copy, delete"),
    ("trainer.gradient_analysis_only", True, "trainer.gradient_analysis_only=True: only False is supported: fastpo "
                                             "always trains after the analysis"),
    ("trainer.max_critic_ckpt_to_keep", 3, "trainer.max_critic_ckpt_to_keep=3: accepted: the value of "
                                           "trainer.max_actor_ckpt_to_keep (1)"),
    ("algorithm.zero_task_advantage", "yes", "algorithm.zero_task_advantage='yes': accepted: true or false"),
    ("agent_proxy.reward_normalization.method", "mean_std", "only 'identity' is supported"),
])
def test_values_fastpo_cannot_honour_are_refused_in_one_line(key, value, message):
    settings = {**S.COMMON_TODAY, **S.EXPERIMENTS_TODAY["_2_sokoban"], key: value}
    cfg = nested(settings)
    cfg["custom_envs"] = copy.deepcopy(S.CUSTOM_ENVS_TODAY["_2_sokoban"])
    with pytest.raises(rc.PortError) as err:
        rc.port(cfg)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and message in lines[0], str(err.value)


def test_paper_time_lora_block():
    """lora.enabled true maps the rank; the per-role copies must agree with the top-level block."""
    flat = {**S.COMMON_PAPER, **S.EXPERIMENTS_PAPER["_2_sokoban"]}
    on = {k: (True if k.endswith("lora.enabled") else v) for k, v in flat.items()}
    cfg = nested(on)
    cfg["custom_envs"] = copy.deepcopy(S.CUSTOM_ENVS_PAPER["_2_sokoban"])
    out, _ = rc.port(cfg)
    assert (out["model"]["lora_rank"], out["model"]["lora_alpha"], out["model"]["lora_target_modules"]) == (
        64, 64, "all-linear")
    cfg["critic"]["lora"]["rank"] = 8
    with pytest.raises(rc.PortError, match=r"critic.lora.rank=8: fastpo uses one LoRA setting for actor, rollout and "
                                           r"critic; accepted: lora.rank's value 64"):
        rc.port(cfg)


def test_advantage_options_off_grpo_are_noted_not_set():
    out, notes = rc.port({"algorithm": {"adv_estimator": "gae", "soft_advantage_reweight": True},
                          "grpo_advantage_length_weight": True})
    assert "soft_advantage_reweight" not in out["algorithm"] and "grpo_length_weight" not in out["algorithm"]
    assert sum("RAGEN applies it to GRPO only" in n for n in notes) == 2
    out, _ = rc.port({"algorithm": {"adv_estimator": "grpo", "soft_advantage_reweight": True,
                                    "norm_adv_by_std_in_grpo": False}, "grpo_advantage_length_weight": True})
    assert out["algorithm"] == {"adv_estimator": "grpo", "soft_advantage_reweight": True, "norm_adv_by_std": False,
                                "grpo_length_weight": True}


def test_messages_say_what_is_missing():
    text = Path(rc.__file__).read_text()
    for phrase in ("this branch", "another change"):
        assert phrase not in text


def test_docs_table_has_every_key_of_every_version():
    """docs/RAGEN.md's key table lists every key of the three versions' experiments (custom_envs per tag key)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "RAGEN.md").read_text()
    keys = set()
    for v in VERSIONS:
        up = v.upper()
        keys |= set(getattr(S, f"COMMON_{up}"))
        for exp in getattr(S, f"EXPERIMENTS_{up}").values():
            keys |= set(exp)
        for tags in getattr(S, f"CUSTOM_ENVS_{up}").values():
            for spec in tags.values():
                keys |= {f"custom_envs.<tag>.{k}" for k in spec}
                keys |= {f"custom_envs.<tag>.env_config.{k}" for k in (spec.get("env_config") or {})}
    keys = {k for k in keys if ".env_configs." not in k or k.endswith((".tags", ".n_groups"))}
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, missing


# ------------------------------------------------------------------------------------------- end to end
def _small(ported: dict) -> dict:
    """The ported experiment at small sizes for the tiny agent: 4 groups of 4, 4 validation groups."""
    env = ported["env"]
    env.update(env_groups=4, group_size=4, val_groups=4, val_group_size=1)
    for split, total in (("train", 4), ("val", 4)):
        entries = env.get(split) or []
        for entry in entries:
            entry["groups"] = total // len(entries)
    ported["rollout"].update(max_model_len=800, response_length=16)
    ported["optim"].update(mini_batch_size=4, micro_batch_tokens=800)  # the std filter keeps 1 group of 4
    ported.setdefault("trainer", {}).update(iterations=2, val_every=2, save_every=0, log_wandb=False)
    return ported


#: The one case that crosses the process boundary (both CLIs as new interpreters); the other eight call each
#: module's ``main`` in this process: the same code and exit status without ~5 CPU-s of imports per launch.
SUBPROCESS_CASE = ("today", "_2_sokoban")


def _run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``python -m fastpo.<argv[0]> argv[1:]`` as a new interpreter: (exit status, out, err)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-m", f"fastpo.{argv[0]}", *argv[1:]], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=600)
    return res.returncode, res.stdout, res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("version", VERSIONS)
def test_ported_experiment_trains_from_the_command_line(version, experiment, tmp_path, capsys):
    """RAGEN YAML (written from the test data) -> python -m fastpo.ragen_config -> python -m fastpo.train with the
    tiny agent, 2 iterations and a validation (SUBPROCESS_CASE as new interpreters, the others in this process)."""
    sub = (version, experiment) == SUBPROCESS_CASE
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / f"{experiment}.yaml").write_text(yaml.safe_dump(ragen(version, experiment), sort_keys=False))
    if sub:
        status, out, err = _run(["ragen_config", str(folder / f"{experiment}.yaml")], tmp_path)
    else:
        capsys.readouterr()
        status = rc.main([str(folder / f"{experiment}.yaml")])
        out, err = capsys.readouterr()
    assert status == 0, err
    ported = _small(yaml.safe_load(out))
    (tmp_path / "ported.yaml").write_text(yaml.safe_dump(ported, sort_keys=False))
    run_dir = tmp_path / "run"
    args = ["--config", str(tmp_path / "ported.yaml"), "--model.path", "tiny", "--model.dtype", "float32",
            "--model.gradient_checkpointing", "false"]
    if sub:
        status, out, err = _run(["train", *args, "--trainer.run_dir", str(run_dir)], tmp_path)
    else:
        status, out, err = _main(args, run_dir, capsys)  # test_trainer's: fastpo.train's main in this process
    assert status == 0, f"{out[-2000:]}\n{err[-4000:]}"
    rows = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("val/success_rate" in r or any(k.startswith("val") for k in r) for r in rows)
    assert max(r.get("step", 0) for r in rows) == 2
