"""fastpo.ragen_config: a RAGEN-style YAML (base + envs + experiment file, written here) ports to a fastpo YAML that
fastpo's own config accepts, with every value where RAGEN put it; unmappable keys are refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastpo.config import Config
from fastpo.config_load import merge
from fastpo.env_mix import resolve_mix
from fastpo.preflight import validate
from fastpo.ragen_config import PortError, load_ragen_yaml, port

BASE = """
defaults:
  - ppo_trainer
  - envs
seed: {train: 10000, val: 123}
micro_batch_size_per_gpu: 1
ppo_mini_batch_size: 32
model_path: Qwen/Qwen2.5-0.5B-Instruct
enable_response_mask: True
lora: {rank: 0, alpha: 16, target_modules: all-linear}
actor_rollout_ref:
  model: {path: "${model_path}", lora_rank: "${lora.rank}", lora_alpha: "${lora.alpha}"}
  actor:
    ppo_mini_batch_size: ${ppo_mini_batch_size}
    entropy_coeff: 0.001
    use_kl_loss: False
    kl_loss_coef: 0.000
    kl_loss_type: kl
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    optim: {betas: [0.9, 0.999], lr: 1e-6}
  rollout:
    max_model_len: 3600
    response_length: 400
    temperature: 1
    rollout_filter_ratio: 0.25
    rollout_filter_type: std
    val_kwargs: {do_sample: True, temperature: 0.5}
critic:
  model: {path: "${model_path}"}
  optim: {lr: 1e-5}
algorithm: {gamma: 1.0, lam: 1.0, high_level_gamma: 0.95, adv_estimator: gae, bi_level_gae: False,
            kl_ctrl: {type: fixed, kl_coef: 0.000}}
trainer: {project_name: ragen_latest, experiment_name: test, save_freq: -1, total_training_steps: 200,
          val_before_train: True, n_gpus_per_node: 1, test_freq: 10, logger: [console]}
agent_proxy: {max_context_window: -1, max_turn: 5, action_sep: "||", max_actions_per_turn: 5, use_turn_scores: False,
              enable_think: True, reward_normalization: {grouping: state, method: identity}}
es_manager:
  format_penalty: -0.1
  train:
    env_groups: 8
    group_size: 16
    env_configs: {tags: [SimpleSokoban], n_groups: [8]}
  val:
    env_groups: 256
    group_size: 1
    env_configs: {tags: [SimpleSokoban], n_groups: [256]}
"""

ENVS = """
custom_envs:
  SimpleSokoban:
    env_type: sokoban
    max_actions_per_traj: 10
    env_instruction: "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\
 When you are right next to a box, you can push it by moving in the same direction. You cannot push a box through a\
 wall, and you cannot pull a box. The answer should be a sequence of actions, like\
 <answer>Right || Right || Up</answer>"
    max_tokens: 100
    env_config: {dim_x: 6, dim_y: 6, num_boxes: 1, max_steps: 100}
  SlipperyLake:
    env_type: frozen_lake
    max_actions_per_traj: 12
    env_config: {size: 4, is_slippery: True}
  WebShop:
    env_type: webshop
    max_actions_per_traj: 9
"""

EXPERIMENT = """
defaults:
  - base
lora: {rank: 64, alpha: 64}
actor_rollout_ref:
  actor: {optim: {lr: 1e-5}}
algorithm: {adv_estimator: gae, bi_level_gae: True}
agent_proxy: {max_turn: 4}
es_manager:
  train:
    env_groups: 8
    env_configs: {tags: [SimpleSokoban, SlipperyLake], n_groups: [6, 2]}
  val:
    env_groups: 16
    env_configs: {tags: [SimpleSokoban, SlipperyLake], n_groups: [8, 8]}
trainer: {experiment_name: mix-lora}
"""


@pytest.fixture()
def ragen_dir(tmp_path: Path) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "envs.yaml").write_text(ENVS)
    (tmp_path / "mix.yaml").write_text(EXPERIMENT)
    return tmp_path


def test_ported_config_validates_and_keeps_every_value(ragen_dir):
    out, notes = port(load_ragen_yaml(ragen_dir / "mix.yaml"))
    cfg = validate(merge(Config(), out))
    assert (cfg.model.path, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.critic_path) == (
        "Qwen/Qwen2.5-0.5B-Instruct", 64, 64, "")
    assert (cfg.optim.actor_lr, cfg.optim.critic_lr, cfg.optim.mini_batch_size) == (1e-5, 1e-5, 32)
    assert cfg.algorithm.adv_estimator == "bilevel_gae" and cfg.algorithm.gamma_high == 0.95
    assert (cfg.env.max_turns, cfg.env.env_groups, cfg.env.group_size, cfg.env.val_groups) == (4, 8, 16, 16)
    assert cfg.trainer.run_dir == "runs/mix-lora" and cfg.trainer.save_every == 0 and not cfg.trainer.log_wandb
    assert cfg.env.train == [
        {"name": "sokoban", "label": "SimpleSokoban", "groups": 6, "max_actions_per_traj": 10,
         "kwargs": {"dim_room": [6, 6], "num_boxes": 1, "max_steps": 100}},
        {"name": "frozenlake", "label": "SlipperyLake", "groups": 2, "max_actions_per_traj": 12,
         "kwargs": {"size": 4, "is_slippery": True}}]
    val = resolve_mix(cfg.env, "val")
    assert [(e.label, len(e.groups), e.kwargs.get("max_steps")) for e in val] == [
        ("SimpleSokoban", 8, 100), ("SlipperyLake", 8, 12)]  # FrozenLake's step limit raised to its budget
    assert any(n.startswith("micro_batch_size_per_gpu=1: no effect") for n in notes)


def test_unmappable_keys_are_refused_by_name(ragen_dir):
    (ragen_dir / "bad.yaml").write_text(EXPERIMENT.replace("trainer: {experiment_name: mix-lora}",
                                                           "trainer: {experiment_name: x, default_hdfs_dir: /h}")
                                        .replace("[SimpleSokoban, SlipperyLake], n_groups: [8, 8]",
                                                 "[WebShop], n_groups: [16]")
                                        + "agent_proxy: {max_turn: 4, reward_normalization: {method: mean_std}}\n")
    with pytest.raises(PortError) as info:
        port(load_ragen_yaml(ragen_dir / "bad.yaml"))
    msg = str(info.value)
    assert "trainer.default_hdfs_dir: no fastpo equivalent (pass --ignore trainer.default_hdfs_dir to skip it)" in msg
    assert "agent_proxy.reward_normalization.method='mean_std': only 'identity' is supported" in msg
    assert "custom_envs.WebShop.env_type: no fastpo env for 'webshop'" in msg
    out, _ = port(load_ragen_yaml(ragen_dir / "bad.yaml"), ignore=["trainer.default_hdfs_dir",
                                                                   "agent_proxy.reward_normalization",
                                                                   "es_manager.val.env_configs"])
    assert "val" not in out["env"]


@pytest.mark.slow
def test_cli_prints_yaml_that_fastpo_train_reads(ragen_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "fastpo.ragen_config", str(ragen_dir / "mix.yaml")],
                         capture_output=True, text=True, env=env, cwd=ragen_dir, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("# fastpo config ported from RAGEN's")
    (ragen_dir / "ported.yaml").write_text(res.stdout)
    from fastpo.config_load import parse_args

    cfg = parse_args(["--config", str(ragen_dir / "ported.yaml")])
    assert cfg.env.train[1]["label"] == "SlipperyLake" and validate(cfg) is cfg
    bad = subprocess.run([sys.executable, "-m", "fastpo.ragen_config", str(ragen_dir / "missing.yaml")],
                         capture_output=True, text=True, env=env, cwd=ragen_dir, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot read RAGEN config")
    assert yaml.safe_load(res.stdout)["model"]["lora_rank"] == 64


def test_docs_map_every_key():
    """docs/RAGEN.md's tables name every key the porter maps or lists as inert."""
    from fastpo.ragen_keys import INERT, KEY_MAP

    doc = (Path(__file__).resolve().parents[1] / "docs" / "RAGEN.md").read_text()
    missing = [k for k in [*KEY_MAP, *INERT] if f"| `{k}` |" not in doc]
    assert not missing, missing


def test_ragen2_filter_keys_port():
    """RAGEN-2's filter keys (its base.yaml at 20daedc: top_p, value 1, reward_variance, include_zero, linear, eps
    0.01, empty stop 5, no loss scaling) port onto the filter family; a pre-2 largest / smallest filter becomes
    top_k with value = its ratio; an explicit value wins over the ratio (noted)."""
    from fastpo.config import Config
    from fastpo.config_load import merge
    from fastpo.preflight import validate
    from fastpo.ragen_config import port

    rollout = {"rollout_filter_strategy": "top_p", "rollout_filter_value": 1.0, "rollout_filter_ratio": 0.25,
               "rollout_filter_type": "largest", "rollout_filter_metric": "reward_variance",
               "rollout_filter_include_zero": True, "rollout_filter_top_p_prob_mode": "linear",
               "rollout_filter_selection_eps": 0.01, "rollout_filter_empty_stop_steps": 5}
    out, notes = port({"actor_rollout_ref": {"rollout": rollout, "actor": {"filter_loss_scaling": "sqrt"}}})
    assert out["algorithm"] == {"rollout_filter_strategy": "top_p", "rollout_filter_value": 1.0,
                                "rollout_filter_direction": "largest", "rollout_filter_metric": "reward_variance",
                                "rollout_filter_include_zero": True, "rollout_filter_top_p_prob_mode": "linear",
                                "rollout_filter_selection_eps": 0.01, "rollout_filter_empty_stop_steps": 5,
                                "filter_loss_scaling": "sqrt"}
    assert any("rollout_filter_ratio=0.25: not used" in n for n in notes)
    validate(merge(Config(), out))
    old, _ = port({"actor_rollout_ref": {"rollout": {"rollout_filter_ratio": 0.5, "rollout_filter_type": "smallest"}}})
    assert old["algorithm"] == {"rollout_filter_direction": "smallest", "rollout_filter_strategy": "top_k",
                                "rollout_filter_value": 0.5}
    paper, _ = port({"actor_rollout_ref": {"rollout": {"rollout_filter_ratio": 0.25, "rollout_filter_type": "std"}}})
    assert paper["algorithm"] == {"rollout_filter_ratio": 0.25, "rollout_filter_type": "std"}


@pytest.mark.parametrize("actor, critic, keep", [(1, 1, 1), (None, None, 0), (0, None, 0), (3, 3, 3)])
def test_checkpoint_retention_keys_port(actor, critic, keep):
    """RAGEN's max_actor_ckpt_to_keep / max_critic_ckpt_to_keep (base.yaml at 20daedc: 1 and 1; verl's null and 0
    keep all) are one count here: fastpo's checkpoint holds actor and critic together."""
    from fastpo.config import Config
    from fastpo.config_load import merge
    from fastpo.preflight import validate
    from fastpo.ragen_config import port

    out, _ = port({"trainer": {"max_actor_ckpt_to_keep": actor, "max_critic_ckpt_to_keep": critic}})
    assert out["trainer"] == {"keep_checkpoints": keep}
    assert validate(merge(Config(), out)).trainer.keep_checkpoints == keep


@pytest.mark.parametrize("trainer, line", [
    ({"max_actor_ckpt_to_keep": 2, "max_critic_ckpt_to_keep": 1},
     "trainer.max_critic_ckpt_to_keep=1: accepted: the value of trainer.max_actor_ckpt_to_keep (2)"),
    ({"max_actor_ckpt_to_keep": -1}, "trainer.max_actor_ckpt_to_keep=-1: accepted: null or an integer >= 0"),
    ({"max_critic_ckpt_to_keep": "two"}, "trainer.max_critic_ckpt_to_keep='two': accepted: null or an integer"),
])
def test_bad_checkpoint_retention_keys_are_refused_in_one_line(trainer, line):
    from fastpo.ragen_config import PortError, port

    with pytest.raises(PortError) as err:
        port({"trainer": trainer})
    assert line in str(err.value)


def test_collapse_detection_keys_port():
    """RAGEN-2's collapse_detection (base.yaml at 20daedc: compute_freq 5, both kinds on, num_samples 64,
    micro_batch_size 128) turns fastpo's diagnostics on; where RAGEN computes none they are off, with a note."""
    from fastpo.config import Config
    from fastpo.config_load import merge
    from fastpo.preflight import validate
    from fastpo.ragen_config import port

    section = {"compute_freq": 5, "micro_batch_size": 128, "first_turn_enabled": True, "multi_turn_enabled": True,
               "num_samples": 64}
    out, notes = port({"collapse_detection": section})
    assert out["trainer"] == {"collapse_every": 5, "collapse_first_turn": True, "collapse_multi_turn": True,
                              "collapse_num_samples": 64}
    assert any(n.startswith("collapse_detection.micro_batch_size=128: no effect") for n in notes)
    assert validate(merge(Config(), out)).trainer.collapse_every == 5
    out, _ = port({"collapse_detection": {**section, "num_samples": "all"}})
    assert out["trainer"]["collapse_num_samples"] == 0
    for ragen, why in (({"collapse_detection": {**section, "first_turn_enabled": False, "multi_turn_enabled": False}},
                        "both false"),
                       ({"collapse_detection": section, "agent_proxy": {"enable_think": False}}, "enable_think"),
                       ({"collapse_detection": section, "agent_proxy": {"max_context_window": 2}}, "full history")):
        out, notes = port(ragen)
        assert out["trainer"]["collapse_every"] == 0 and any(why in n for n in notes), ragen
        validate(merge(Config(), out))
    with pytest.raises(PortError, match=r"collapse_detection.num_samples='some': accepted: an integer >= 1 or 'all'"):
        port({"collapse_detection": {"num_samples": "some"}})
    with pytest.raises(PortError, match=r"collapse_detection.compute_freq=0: accepted: an integer >= 1"):
        port({"collapse_detection": {"compute_freq": 0}})


def test_gradient_analysis_keys_port():
    """RAGEN-2's gradient analysis (base.yaml at 20daedc: mode false, every 50, 6 quantile buckets, no separate
    batch) ports off; mode true turns it on every 50; what fastpo does not do is refused by name."""
    from fastpo.config import Config
    from fastpo.config_load import merge
    from fastpo.preflight import validate
    from fastpo.ragen_config import port

    trainer = {"gradient_analysis_mode": False, "gradient_analysis_every": 50, "gradient_analysis_env_groups": None,
               "gradient_analysis_group_size": None, "gradient_analysis_log_prefilter": False,
               "gradient_analysis_only": False, "exit_after_gradient_analysis": False}
    rollout = {"gradient_analysis_num_buckets": 6, "gradient_analysis_bucket_mode": "quantile"}
    out, _ = port({"trainer": trainer, "actor_rollout_ref": {"rollout": rollout}})
    assert out["trainer"] == {"gradient_analysis_every": 0, "gradient_analysis_num_buckets": 6,
                              "gradient_analysis_bucket_mode": "quantile"}
    out, _ = port({"trainer": {**trainer, "gradient_analysis_mode": True}})
    assert validate(merge(Config(), out)).trainer.gradient_analysis_every == 50
    for key, value, line in (("gradient_analysis_only", True, "only False is supported"),
                             ("gradient_analysis_env_groups", 8, "only None is supported"),
                             ("gradient_analysis_mode", "yes", "accepted: true or false")):
        with pytest.raises(PortError, match=f"trainer.{key}="):
            port({"trainer": {**trainer, key: value}})
        with pytest.raises(PortError) as err:
            port({"trainer": {**trainer, key: value}})
        assert line in str(err.value)
    with pytest.raises(PortError, match="gradient_analysis_bucket_mode='median': accepted: quantile, fixed_rv"):
        port({"actor_rollout_ref": {"rollout": {"gradient_analysis_bucket_mode": "median"}}})


def test_ragen_names_on_the_command_line_or_in_a_config_point_to_ours(tmp_path):
    """RAGEN's --algorithm.clip_ratio_low got no hint to eps_low: unknown names are looked up in the port's key
    table (fastpo.ragen_keys.KEY_MAP), among the fields of the entry point that was run."""
    from fastpo.config import ConfigError
    from fastpo.config_load import parse_args
    from fastpo.eval import parse_args as eval_parse_args

    for flag, hint in (("--algorithm.clip_ratio_low", "RAGEN's clip_ratio_low is --algorithm.eps_low"),
                       ("--actor_rollout_ref.actor.clip_ratio_low", "--algorithm.eps_low"),
                       ("--trainer.total_training_steps", "RAGEN's total_training_steps is --trainer.iterations"),
                       ("--optim.lr", "RAGEN's lr is --optim.actor_lr or --optim.critic_lr")):
        with pytest.raises(ConfigError) as err:
            parse_args([flag, "3"])
        assert hint in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:  # eval has no optim section: nothing to point to there
        eval_parse_args(["--optim.lr", "1e-6"])
    assert "RAGEN" not in str(err.value)
    with pytest.raises(ConfigError, match="RAGEN's temperature is --rollout.val_temperature"):
        eval_parse_args(["--rollout.temperature", "0.5"])
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  clip_ratio_high: 0.28\n")
    with pytest.raises(ConfigError, match=r"unknown field 'algorithm.clip_ratio_high'.*RAGEN's clip_ratio_high is "
                                          r"algorithm.eps_high"):
        parse_args(["--config", str(path)])
    path.write_text("actor_rollout_ref:\n  actor:\n    clip_ratio_low: 0.2\n")
    with pytest.raises(ConfigError, match=r"unknown section 'actor_rollout_ref'.* a RAGEN config: port it with "
                                          r"python -m fastpo.ragen_config"):
        parse_args(["--config", str(path)])


def test_a_tags_own_instruction_and_word_limit_reach_the_prompt():
    """RAGEN-2's CoordSokoban has its own env_instruction and max_tokens 120: the ported entry's ``prompt`` puts
    them in the env's prompt; a bad ``prompt`` mapping is one error line naming the entry."""
    from fastpo.env_mix import build_parts

    cfg = Config()
    cfg.env.env_groups, cfg.env.val_groups = 2, 2
    cfg.env.train = [{"name": "sokoban", "label": "CoordSokoban",
                      "prompt": {"env_instruction": "Push the boxes.", "max_tokens": 120}}]
    entries = resolve_mix(cfg.env, "train")
    assert entries[0].prompt == {"env_instruction": "Push the boxes.", "max_tokens": 120}
    part = build_parts(entries, range(2), "python", True, "||")[0]
    try:
        assert part.spec.prefix().startswith("Push the boxes.\nThe meaning of each symbol")
        assert "Max response length: 120 words (tokens)." in part.spec.turn_block("#", 3)
    finally:
        part.env.close()
    cfg.env.train = [{"name": "sokoban", "prompt": {"instruction": "x", "max_tokens": 0}}]
    with pytest.raises(ValueError) as err:
        resolve_mix(cfg.env, "train")
    msg = str(err.value)
    assert "env.train[0].prompt: unknown key 'instruction'; accepted: ['env_instruction', 'max_tokens']" in msg
    assert "env.train[0].prompt.max_tokens must be an int >= 1, got 0" in str(err.value)
