"""fastpo.config: defaults, presets, CLI / YAML parsing, JSON round trip, hash and validation messages."""

import dataclasses
import hashlib
import json
import math

import pytest

from fastpo import cli_schema
from fastpo import config as C
from fastpo.config import Config, ConfigError
from fastpo.config_load import from_json, parse_args
from fastpo.preflight import validate
from fastpo.presets import PRESETS, get_preset


def test_defaults_are_ragen_starpo_s():
    cfg = Config()
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (cfg.env.env_groups, cfg.env.group_size, cfg.env.max_turns) == (8, 16, 5)
    assert (cfg.env.max_actions_per_turn, cfg.env.max_actions_per_traj) == (5, 10)
    assert (cfg.env.val_groups, cfg.env.val_seed, cfg.rollout.val_temperature) == (256, 123, 0.5)
    assert (cfg.rollout.response_length, cfg.rollout.max_model_len, cfg.rollout.format_penalty) == (400, 3600, -0.1)
    a = cfg.algorithm
    assert (a.adv_estimator, a.gamma, a.lam, a.gamma_high) == ("gae", 1.0, 1.0, 0.95)
    assert (a.rollout_filter_ratio, a.rollout_filter_type, a.eps_low, a.eps_high, a.clip_c) == (0.25, "std", 0.2,
                                                                                               0.28, 3.0)
    assert (a.entropy_coef, a.kl_coef, a.kl_type, a.value_clip, a.loss_agg_mode) == (0.001, 0.0, "k1", 0.5,
                                                                                    "token-mean")
    o = cfg.optim
    assert (o.actor_lr, o.critic_lr, o.betas, o.weight_decay, o.grad_clip, o.ppo_epochs) == (1e-6, 1e-5, (0.9, 0.999),
                                                                                          0.01, 1.0, 1)
    assert (cfg.trainer.iterations, cfg.trainer.val_every, cfg.trainer.val_before_train) == (200, 10, True)
    assert get_preset("sokoban") == cfg


def test_every_field_has_a_docstring():
    for section in C.SECTIONS:
        cls = C._section_cls(section)
        docs = cli_schema.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert len(docs.get(f.name, "")) > 10, f"{section}.{f.name} has no docstring"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip(name, tmp_path):
    cfg = get_preset(name)
    if name == "metamathqa":  # the preset names no data file (fastpo downloads nothing): the user adds one
        with pytest.raises(ConfigError, match="env 'metamathqa'.*data_path"):
            validate(cfg, world_size=1)
        data = tmp_path / "qa.jsonl"
        data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
        cfg.env.kwargs = {"data_path": str(data)}
    validate(cfg, world_size=1)
    assert from_json(C.to_json(cfg)) == cfg


def test_preset_contents():
    v = get_preset("starpo-vanilla").algorithm
    assert (v.rollout_filter_ratio, v.kl_coef, v.kl_type, v.eps_low, v.eps_high) == (1.0, 0.001, "k1", 0.2, 0.2)
    assert get_preset("grpo").algorithm.adv_estimator == "grpo"
    assert get_preset("bandit").env.max_turns == 1
    tiny = get_preset("tiny")
    assert tiny.model.path == "tiny" and tiny.env.names == ("frozenlake",) and tiny.env.kwargs == {"is_slippery": False}
    assert not tiny.rollout.enable_think and tiny.env.max_actions_per_turn == 2  # what the shipped agent was taught
    assert tiny.algorithm.adv_estimator == "gigpo" and tiny.algorithm.rollout_filter_ratio < 1  # StarPO-S + GiGPO
    assert tiny.env.val_groups == 256 and tiny.trainer.val_before_train
    validate(tiny, world_size=2)
    validate(get_preset("sokoban"), world_size=8)
    with pytest.raises(ConfigError, match="--preset.*'sokobn'.*did you mean sokoban"):
        parse_args(["--preset", "sokobn"])


def test_presets_are_fresh_objects():
    a = get_preset("sokoban")
    a.env.names = ("bandit",)
    assert get_preset("sokoban").env.names == ("sokoban",)


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_overrides_every_type():
    cfg = parse_args([
        "--algorithm.eps_high", "0.3", "--optim.actor_lr=2e-6", "--env.group_size", "4",
        "--trainer.log_wandb", "--model.gradient_checkpointing=false", "--optim.betas", "0.8,0.95",
        "--env.names", "[sokoban, frozenlake]", "--algorithm.kl_type", "k3", "--env.kwargs", "{dim_room: [8, 8]}",
        "--rollout.format_penalty", "-0.2", "--algorithm.clip_c", "inf", "--trainer.run_dir", "runs/x",
    ])
    assert cfg.algorithm.eps_high == 0.3 and cfg.optim.actor_lr == 2e-6 and cfg.env.group_size == 4
    assert cfg.trainer.log_wandb is True and cfg.model.gradient_checkpointing is False
    assert cfg.optim.betas == (0.8, 0.95) and cfg.env.names == ("sokoban", "frozenlake")
    assert cfg.algorithm.kl_type == "k3" and cfg.env.kwargs == {"dim_room": [8, 8]}
    assert cfg.rollout.format_penalty == -0.2 and math.isinf(cfg.algorithm.clip_c)
    assert cfg.trainer.run_dir == "runs/x"
    assert from_json(C.to_json(cfg)) == cfg  # inf survives JSON


@pytest.mark.parametrize("argv,pieces", [
    (["--algorithm.eps_high", "abc"], ["algorithm.eps_high", "float", "'abc'"]),
    (["--env.group_size", "2.5"], ["env.group_size", "int", "'2.5'"]),
    (["--trainer.log_wandb=maybe"], ["trainer.log_wandb", "bool", "'maybe'"]),
    (["--algorithm.loss_agg_mode", "mean"], ["algorithm.loss_agg_mode", "token-mean", "'mean'"]),
    (["--rollout.engine", "vlm"], ["rollout.engine", "'vlm'", "did you mean vllm"]),
    (["--optim.betas", "0.9"], ["optim.betas", "2 values"]),
    (["--env.kwargs", "[1, 2]"], ["env.kwargs", "mapping"]),
    (["--algorithm.eps_hgh", "0.3"], ["algorithm.eps_hgh", "did you mean --algorithm.eps_high"]),
    (["--algorithm.adv_estimatr=gae"], ["did you mean --algorithm.adv_estimator"]),
    (["--env.group_size"], ["env.group_size", "Missing value"]),
    (["algorithm.eps_high=0.3"], ["Unrecognized options: algorithm.eps_high=0.3"]),
    (["--config", "/nonexistent/x.yaml"], ["--config", "/nonexistent/x.yaml"]),
])
def test_cli_errors_name_field_value_and_type(argv, pieces):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    for piece in pieces:
        assert piece in str(err.value)


def test_help_lists_every_field_with_its_docstring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for dotted in C.all_fields():
        assert f"--{dotted} " in out
    assert "Share of groups kept by the std / std_rev filter" in out
    assert "starpo-vanilla" in out


def test_yaml_merge_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  iterations: 7\nalgorithm:\n  eps_high: 0.25\n  clip_c: .inf\n"
                    "optim:\n  betas: [0.5, 0.6]\n")
    cfg = parse_args(["--algorithm.eps_high", "0.3", "--config", str(path), "--preset", "tiny"])
    assert cfg.model.path == "tiny"  # preset
    assert cfg.trainer.iterations == 7 and cfg.optim.betas == (0.5, 0.6)  # yaml over preset
    assert math.isinf(cfg.algorithm.clip_c)
    assert cfg.algorithm.eps_high == 0.3  # CLI over yaml, wherever it stands


@pytest.mark.parametrize("text,pieces", [
    ("algoritm:\n  eps_high: 0.3\n", ["unknown section 'algoritm'", "did you mean algorithm"]),
    ("algorithm:\n  eps_hi: 0.3\n", ["algorithm.eps_hi", "did you mean algorithm.eps_high"]),
    ("algorithm:\n  eps_high: high\n", ["algorithm.eps_high", "float", "'high'"]),
    ("algorithm: 3\n", ["section 'algorithm' must be a mapping"]),
])
def test_yaml_errors(tmp_path, text, pieces):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    for piece in pieces:
        assert piece in str(err.value)


def test_json_round_trip_and_partial_json():
    cfg = parse_args(["--preset", "bandit", "--env.kwargs", "{a: 1}"])
    text = C.to_json(cfg)
    assert from_json(text) == cfg
    assert json.loads(text)["env"]["val_names"] == ["bandit", "bandit_test"]
    assert from_json('{"algorithm": {"eps_high": 0.3}}').algorithm.eps_high == 0.3
    with pytest.raises(ConfigError, match="model.nope"):
        from_json('{"model": {"nope": 1}}')


def test_config_hash_covers_math_only():
    base = Config()
    h = C.config_hash(base)
    assert len(h) == 16 and h == C.config_hash(Config()) == C.config_hash(from_json(C.to_json(base)))
    same = parse_args(["--trainer.run_dir", "elsewhere", "--trainer.log_wandb", "--trainer.iterations", "400",
                       "--trainer.val_every", "5", "--trainer.resume", "never", "--trainer.keep_checkpoints", "9"])
    assert C.config_hash(same) == h
    for override in (["--algorithm.eps_high", "0.3"], ["--env.group_size", "8"], ["--trainer.seed", "1"],
                     ["--model.path", "other"], ["--optim.betas", "0.9,0.99"]):
        assert C.config_hash(parse_args(override)) != h, override
    # a field added later hashes only when set: checkpoints written before it existed still resume
    data = C.to_dict(base)
    del data["optim"]["defer_grad_sync"]
    del data["algorithm"]["old_logprobs"]
    for section, key in [("algorithm", "offpolicy_correction"), ("algorithm", "is_cap"), ("algorithm", "is_mask_low"),
                         ("algorithm", "is_mask_high"), ("rollout", "mode"), ("rollout", "max_num_seqs"),
                         ("rollout", "partial"), ("rollout", "max_staleness"), ("algorithm", "refill_rounds"),
                         *[("algorithm", k) for k in ("rollout_filter_strategy", "rollout_filter_value",
                                                      "rollout_filter_metric", "rollout_filter_direction",
                                                      "rollout_filter_include_zero", "rollout_filter_top_p_prob_mode",
                                                      "rollout_filter_selection_eps", "rollout_filter_empty_stop_steps",
                                                      "filter_loss_scaling", "zero_task_advantage",
                                                      "soft_advantage_reweight", "grpo_length_weight",
                                                      "batch_adjust_mode")], ("rollout", "context_window_mode"),
                         ("rollout", "partial_kv"), ("rollout", "partial_interrupt"), ("rollout", "partial_spare")]:
        del data[section][key]  # added after the first checkpoints, like the two above
    data["trainer"] = {k: v for k, v in data["trainer"].items() if k not in C.TrainerConfig._unhashed}
    del data["env"]["preflight_timeout_s"]  # a limit on the checks, not math: never hashed
    assert h == hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    assert C.config_hash(parse_args(["--env.preflight_timeout_s", "600"])) == h
    assert C.config_hash(parse_args(["--optim.defer_grad_sync", "true"])) != h
    assert C.config_hash(parse_args(["--algorithm.old_logprobs", "engine"])) != h
    assert C.config_hash(parse_args(["--algorithm.refill_rounds", "2"])) != h
    assert C.config_hash(parse_args(["--rollout.partial_kv", "keep"])) != h
    assert C.config_hash(parse_args(["--rollout.partial_interrupt", "true"])) != h


# ------------------------------------------------------------------------------------------------ validate
def _set(**changes):
    cfg = Config()
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize("cfg,world_size,fields", [
    (_set(env__env_groups=6), 4, ["env.env_groups", "world size (4)"]),
    (_set(algorithm__rollout_filter_ratio=0.1), 1, ["algorithm.rollout_filter_ratio", "at least 1"]),
    (_set(algorithm__rollout_filter_ratio=0.125), 1, ["algorithm.rollout_filter_ratio", "optim.mini_batch_size"]),
    (_set(algorithm__rollout_filter_ratio=1.5), 1, ["algorithm.rollout_filter_ratio", "(0, 1]"]),
    (_set(algorithm__adv_estimator="ppo"), 1, ["algorithm.adv_estimator", "'ppo'", "grpo"]),
    (_set(algorithm__rollout_filter_type="max_mean"), 1, ["algorithm.rollout_filter_type", "'max_mean'"]),
    (_set(algorithm__loss_agg_mode="mean"), 1, ["algorithm.loss_agg_mode", "'mean'"]),
    (_set(algorithm__kl_type="k2"), 1, ["algorithm.kl_type", "'k2'"]),
    (_set(algorithm__old_logprobs="vllm"), 1, ["algorithm.old_logprobs", "'vllm'", "'engine'"]),
    (_set(algorithm__old_logprobs="engine", rollout__train_on_observations=True), 1,
     ["algorithm.old_logprobs=engine", "rollout.train_on_observations=false"]),
    (_set(algorithm__policy_loss="gspo"), 1, ["algorithm.policy_loss", "'gspo'"]),
    (_set(optim__critic_lr=0.0), 1, ["optim.critic_lr", "critic"]),
    (_set(algorithm__adv_estimator="grpo", model__critic_path="x"), 1, ["model.critic_path", "no critic"]),
    (_set(optim__actor_lr=-1e-6), 1, ["optim.actor_lr"]),
    (_set(optim__critic_lr=-1.0), 1, ["optim.critic_lr"]),
    (_set(env__names=("sokobann",)), 1, ["env.names", "'sokobann'", "did you mean sokoban"]),
    (_set(env__names="sokoban"), 1, ["env.names", "tuple"]),
    (_set(env__group_size=1, algorithm__adv_estimator="grpo"), 1, ["env.group_size", "grpo"]),
    (_set(optim__mini_batch_size=30), 4, ["optim.mini_batch_size", "world size"]),
    (_set(optim__micro_batch_tokens=1024), 1, ["optim.micro_batch_tokens", "rollout.max_model_len"]),
    (_set(rollout__max_model_len=300), 1, ["rollout.max_model_len", "rollout.response_length"]),
    (_set(rollout__top_p=0.0), 1, ["rollout.top_p"]),
    (_set(algorithm__clip_c=1.0), 1, ["algorithm.clip_c"]),
    (_set(algorithm__eps_low=1.0), 1, ["algorithm.eps_low"]),
    (_set(algorithm__gamma=1.5), 1, ["algorithm.gamma"]),
    (_set(algorithm__gigpo_step_gamma=1.5), 1, ["algorithm.gigpo_step_gamma"]),
    (_set(algorithm__gigpo_step_weight=-1.0), 1, ["algorithm.gigpo_step_weight"]),
    (_set(algorithm__adv_estimator="gigpo", env__group_size=1), 1, ["env.group_size", "gigpo"]),
    (_set(trainer__keep_checkpoints=-1), 1, ["trainer.keep_checkpoints must be >= 0 (0 = keep all), got -1"]),
    (_set(env__val_groups=100), 3, ["env.val_groups"]),
    (_set(optim__betas=(0.9, 1.0)), 1, ["optim.betas"]),
    (Config(), 0, ["world_size"]),
])
def test_validate_errors_name_their_fields(cfg, world_size, fields):
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size)
    for piece in fields:
        assert piece in str(err.value)


def test_validate_lists_every_problem_at_once():
    cfg = _set(optim__actor_lr=-1.0, trainer__keep_checkpoints=-1, rollout__temperature=0.0)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    assert "optim.actor_lr" in text and "trainer.keep_checkpoints" in text and "rollout.temperature" in text


def test_keep_checkpoints_zero_keeps_all_and_the_old_name_is_read_from_files(tmp_path):
    assert validate(_set(trainer__keep_checkpoints=0)).trainer.keep_checkpoints == 0
    assert parse_args(["--trainer.keep_checkpoints", "5"]).trainer.keep_checkpoints == 5
    # a run's config.json written before the rename says keep_last: it still resumes and evaluates
    assert from_json('{"trainer": {"keep_last": 4}}').trainer.keep_checkpoints == 4
    old = tmp_path / "config.json"
    old.write_text('{"trainer": {"keep_last": 7}}')
    assert parse_args(["--config", str(old)]).trainer.keep_checkpoints == 7
    assert C.is_field("trainer.keep_last") and C.is_field("trainer.keep_checkpoints")
    assert not C.is_field("trainer.keep_nothing")


def test_nonzero_filter_skips_group_count_checks():
    validate(_set(algorithm__rollout_filter_type="nonzero", algorithm__rollout_filter_ratio=0.01))


@pytest.mark.parametrize(
    "argv,field",
    [(["--rollout.engine", "vllm", "--rollout.top_p", "0.9"], "rollout.engine")],
)
def test_features_not_wired_into_the_trainer_are_refused_by_validate(argv, field):
    cfg = parse_args(["--preset", "tiny", *argv])
    with pytest.raises(ConfigError, match=field):
        validate(cfg, 1)


def test_command_line_without_tyro(tmp_path):
    """A machine without tyro (the GPU image): the entry points still import, and the same flags parse through the
    plain parser with the same coercion and one-line errors; --help lists the fields."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.modules["tyro"] = sys.modules["tyro.conf"] = None  # import tyro -> ModuleNotFoundError
        import fastpo.report, fastpo.ragen_config, fastpo.train  # noqa: F401  (import without tyro)
        from fastpo.config import ConfigError
        from fastpo.config_load import parse_args
        cfg = parse_args(["--preset", "tiny", "--rollout.mode", "async", "--algorithm.eps_high=0.3",
                          "--rollout.stop", "</answer>,</think>", "--optim.defer_grad_sync", "--env.train_seed", "-5"])
        assert (cfg.rollout.mode, cfg.algorithm.eps_high, cfg.rollout.stop) == ("async", 0.3, ("</answer>", "</think>"))
        assert cfg.optim.defer_grad_sync is True and cfg.env.train_seed == -5 and cfg.model.path == "tiny"
        for bad, words in ((["--rollout.mode", "sideways"], "rollout.mode: expected one of"),
                           (["--optim.actor_lrr", "1"], "unknown field 'optim.actor_lrr'; did you mean optim.actor_lr"),
                           (["tiny"], "unexpected argument 'tiny'")):
            try:
                parse_args(bad)
            except ConfigError as err:
                assert words in str(err), (bad, str(err))
            else:
                raise AssertionError(bad)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    helped = subprocess.run([sys.executable, "-c", "import sys; sys.modules['tyro'] = sys.modules['tyro.conf'] = "
                             "None; from fastpo.config_load import parse_args; parse_args(['--help'])"],
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--rollout.max_staleness int (default 1)" in helped.stdout, helped.stderr[-2000:]
