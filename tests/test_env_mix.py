"""Per-env mixes (env.train / env.val): schema checks before any model loads, contiguous group blocks, per-env
budgets in the prompt, step limits that follow the budget, and world-size-independent trajectory numbering."""

from __future__ import annotations

import json

import pytest
import torch

from fastpo import distributed as du
from fastpo import envs
from fastpo.config import Config, ConfigError, to_json
from fastpo.config_load import from_json, parse_args
from fastpo.env_mix import resolve_mix, trajectory_offsets
from fastpo.preflight import validate
from fastpo.presets import get_preset
from fastpo.prompts import Turn, build_messages

MIX = [{"name": "sokoban", "groups": 6, "max_actions_per_traj": 12},
       {"name": "frozenlake", "label": "Lake", "groups": 2, "kwargs": {"is_slippery": False}, "group_size": 4}]


def _cfg(*args: str) -> Config:
    return parse_args(["--env.train", json.dumps(MIX), "--optim.mini_batch_size", "8", *args])


def _errors(cfg: Config, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size)
    return str(info.value)


def test_cli_and_yaml_round_trip(tmp_path):
    cfg = _cfg()
    assert cfg.env.train == MIX and validate(cfg) is cfg
    assert from_json(to_json(cfg)) == cfg
    (tmp_path / "mix.yaml").write_text("env:\n  train:\n    - {name: sokoban, groups: 6, max_actions_per_traj: 12}\n"
                                       "    - {name: frozenlake, label: Lake, groups: 2, group_size: 4,"
                                       " kwargs: {is_slippery: false}}\n")
    assert parse_args(["--config", str(tmp_path / "mix.yaml")]).env.train == MIX
    msg = _errors(parse_args(["--config", str(tmp_path / "mix.yaml")]))  # the smallest group size counts
    assert "keeps 2 groups x env.group_size 4 = 8 trajectories, fewer than optim.mini_batch_size (32)" in msg
    with pytest.raises(ConfigError, match=r"env.train: expected a YAML / JSON list"):
        parse_args(["--env.train", '{"name": "sokoban"}'])


def test_entries_own_contiguous_blocks_with_their_own_settings():
    train = resolve_mix(_cfg().env, "train")
    assert [(e.name, e.label, e.groups, e.group_size) for e in train] == [
        ("sokoban", "Sokoban", [0, 1, 2, 3, 4, 5], 16), ("frozenlake", "Lake", [6, 7], 4)]
    assert train[0].kwargs == {"max_steps": 12} and train[0].max_actions_per_traj == 12  # raised with the budget
    assert train[1].kwargs == {"is_slippery": False, "max_steps": 10} and train[1].max_actions_per_traj == 10
    assert (train[0].max_turns, train[0].max_actions_per_turn) == (5, 5)  # the global defaults
    val = resolve_mix(_cfg("--env.val_groups", "4").env, "val")  # no env.val: the train entries, split equally
    assert [(e.label, e.groups, e.group_size) for e in val] == [("Sokoban", [0, 1], 1), ("Lake", [2, 3], 1)]
    offsets = trajectory_offsets(train)
    assert [offsets[g] for g in range(8)] == [0, 16, 32, 48, 64, 80, 96, 100]


def test_legacy_fields_resolve_as_before():
    cfg = parse_args(["--env.names", "sokoban,frozenlake", "--env.kwargs", '{"max_steps": 10}'])
    entries = resolve_mix(cfg.env, "train")
    assert [e.groups for e in entries] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # round-robin, as before
    assert all(e.max_actions_per_traj == 10 and e.kwargs == {"max_steps": 10} for e in entries)
    raised = resolve_mix(parse_args(["--env.max_actions_per_traj", "15"]).env, "train")[0]
    assert raised.kwargs == {"max_steps": 15}  # a budget above 10 no longer stops silently at 10
    assert envs.make("sokoban", 1, **raised.kwargs).config.max_steps == 15


@pytest.mark.parametrize("name, budget, limit", [
    ("sokoban", 15, 15), ("frozenlake", 15, 15), ("rubikscube", 50, 50), ("sudoku", 100, 100), ("2048", 800, 800),
    ("simple_sudoku", 10, 81), ("rubikscube", 10, 20),  # a budget below the env's own limit keeps that limit
    ("bandit", 10, None), ("countdown", 10, None), ("metamathqa", 10, None),  # one action (or attempt): as they are
])
def test_legacy_step_limit_follows_the_budget_for_every_env_that_has_one(name, budget, limit):
    """The single-config mode raises every built-in env's default step limit to env.max_actions_per_traj (the
    grids, 2048, Sudoku, the cube: the cube used to stop at 20 actions while its prompt promised 50); the envs that
    end after one action are left as they are (the global default budget 10 reaches them too)."""
    cfg = parse_args(["--env.names", name, "--env.max_actions_per_traj", str(budget)])
    entry = resolve_mix(cfg.env, "train")[0]
    assert entry.kwargs == ({} if limit is None else {"max_steps": limit})
    if limit is not None:
        assert envs.make(name, 1, backend="python", **entry.kwargs).config.max_steps == limit


def test_parts_over_ranks_equal_one_rank():
    """Each rank builds the parts of its own groups; together they are the 1-rank parts, with the same trajectory
    numbers (hence sampling seeds)."""
    from fastpo.env_mix import build_parts

    cfg = _cfg("--env.backend", "python")
    entries = resolve_mix(cfg.env, "train")

    def parts(world: int, rank: int) -> list[tuple]:
        out = build_parts(entries, du.shard_groups(8, world, rank), "python", True, "||")
        return [(p.entry.name, g, p.entry.group_size, first, p.spec.max_actions_per_traj)
                for p in out for g, first in zip(p.groups, p.first_index, strict=True)]

    one = parts(1, 0)
    assert sorted(parts(2, 0) + parts(2, 1)) == sorted(one) and len(one) == 8
    assert parts(2, 1)[-1] == ("frozenlake", 7, 4, 100, 10)


def test_per_env_budget_reaches_the_prompt(tmp_path):
    """MetaMathQA in a mix shows RAGEN's budget of 1, Sokoban its 12 (not one global 10)."""
    from fastpo.env_mix import build_parts

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    mix = [{"name": "sokoban", "groups": 1, "max_actions_per_traj": 12},
           {"name": "metamathqa", "groups": 1, "kwargs": {"data_path": str(data)}}]
    cfg = parse_args(["--env.train", json.dumps(mix), "--env.env_groups", "2", "--algorithm.rollout_filter_ratio", "1"])
    validate(cfg)
    parts = build_parts(resolve_mix(cfg.env, "train"), range(2), "default", True, "||")
    texts = {}
    for p in parts:
        obs = p.env.reset([7] * p.env.num_envs)
        texts[p.entry.name] = build_messages(p.spec, [Turn(obs[0], actions_left=p.spec.max_actions_per_traj)])
    assert "You have 1 actions left." in texts["metamathqa"][1]["content"]
    assert "You have 12 actions left." in texts["sokoban"][1]["content"]
    assert "You can make up to 12 actions" in texts["sokoban"][1]["content"]
    assert parts[1].entry.label == "MetamathQA"


def test_bad_mixes_are_refused_before_any_model_loads(tmp_path):
    msg = _errors(parse_args(["--env.train", '[{"name": "sokobn", "groups": 8}]']))
    assert "env.train[0].name: unknown env 'sokobn'" in msg and "did you mean sokoban" in msg
    two = '[{"name": "sokoban", "groups": 4}, {"name": "frozenlake", "groups": 2}]'
    msg = _errors(parse_args(["--env.train", two]))
    assert "the entries' groups add up to 6, but env.env_groups is 8" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "sokoban", "groups": 6}, {"name": "frozenlake"}]']))
    assert "give 'groups' in every entry or in none" in msg
    msg = _errors(_cfg("--env.env_groups", "8"), world_size=3)
    assert "env.env_groups (8) must be divisible by the world size (3)" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "frozenlake", "kwargs": {"slippery": false}}]']))
    assert "env.train[0].kwargs: env 'frozenlake' rejects {'slippery': False" in msg and "'is_slippery'" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "frozenlake", "kwargs": {"max_steps": 5}}]']))
    assert "its step limit max_steps=5 is below the action budget 10" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "bandit", "max_actions_per_traj": 3}]']))
    assert "env 'bandit': an episode ends after one action, so its action budget must be 1, got 3" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "sokoban", "label": "S"}, {"name": "sokoban", "label": "S"}]']))
    assert "label 'S' is used by more than one entry" in msg
    msg = _errors(parse_args(["--env.train", '[{"name": "sokoban", "group": 8}]']))
    assert "env.train[0]: unknown key 'group'" in msg and "did you mean groups?" in msg
    msg = _errors(_cfg("--env.val_names", "sokoban"))
    assert "env.val_names cannot be combined with env.train" in msg
    msg = _errors(_cfg("--algorithm.adv_estimator", "grpo", "--env.train",
                       '[{"name": "sokoban", "group_size": 1, "groups": 8}]'))
    assert "env.group_size must be >= 2" in msg


def test_presets_for_ragen_configs():
    lora = get_preset("sokoban-lora")
    assert (lora.model.lora_rank, lora.model.lora_alpha, lora.model.lora_target_modules) == (64, 64, "all-linear")
    assert (lora.optim.actor_lr, lora.optim.critic_lr) == (1e-5, 1e-4)
    qa = get_preset("metamathqa")
    assert qa.env.names == ("metamathqa",) and qa.env.max_actions_per_traj == 1


# A mix with its own kwargs, group sizes and a budget above 10, through the real entry point.
RUN_MIX = [{"name": "frozenlake", "groups": 2, "kwargs": {"is_slippery": False}, "max_actions_per_traj": 12},
           {"name": "sokoban", "label": "SmallSokoban", "groups": 2, "group_size": 2, "max_turns": 1}]


@pytest.mark.slow
def test_mix_one_rank_equals_two_ranks_and_resumes_exactly(tmp_path, capsys):
    # the 1-process runs in this process (fastpo.train's main), the 2-rank one under torchrun
    from test_trainer import GAE, SMALL, _main_ok, _metrics, _ok, _weights

    args = [*SMALL, *GAE, "--env.train", json.dumps(RUN_MIX), "--optim.mini_batch_size", "4",
            "--trainer.deterministic", "true"]
    _main_ok([*args, "--trainer.iterations", "1"], tmp_path / "one", capsys)
    _ok([*args, "--trainer.iterations", "1"], tmp_path / "two", nproc=2)
    a, b = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    assert "env/SmallSokoban/success" in a and "env/FrozenLake/success" in a
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "rollout/reward", "env/FrozenLake/num_actions",
                "env/SmallSokoban/num_actions"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # exact resume: 2 iterations straight == 1 (the run above) + resume to 2
    _main_ok([*args, "--trainer.iterations", "2"], tmp_path / "straight", capsys)
    out = _main_ok([*args, "--trainer.iterations", "2"], tmp_path / "one", capsys)
    assert "resumed from step 1" in out
    s, r = _metrics(tmp_path / "straight"), _metrics(tmp_path / "one")
    keys = [k for k in s[1] if k.startswith(("actor/", "critic/", "rollout/reward", "env/")) and not k.endswith("_s")]
    assert {k: s[1][k] for k in keys} == {k: r[1][k] for k in keys}
    ws, wr = _weights(tmp_path / "straight" / "hf"), _weights(tmp_path / "one" / "hf")
    assert all(torch.equal(ws[k], wr[k]) for k in ws)


@pytest.mark.parametrize("args,words", [
    (["--env.val_groups", "0"], "env.val_groups must lie in [1, 4194304], got 0"),
    (["--env.val_groups", "99999999999"], "env.val_groups must lie in [1, 4194304], got 99999999999"),
    (["--env.env_groups", "-3"], "env.env_groups must lie in [1, 4194304], got -3"),
    (["--env.val_group_size", "0"], "env.val_group_size must lie in [1, 4194304], got 0"),
    (["--env.val_groups", "4096", "--env.val_group_size", "4096"],
     "env.val_groups (4096) x env.val_group_size (4096) = 16777216 episodes per validation; at most 4194304"),
    (["--env.train", '[{"name": "sokoban", "groups": 99999999999}]', "--env.env_groups", "99999999999"],
     "env.env_groups must lie in [1, 4194304], got 99999999999"),
    (["--env.train", '[{"name": "sokoban", "groups": 99999999999}, {"name": "bandit", "groups": 1}]'],
     "env.train[0].groups must lie in [1, 4194304], got 99999999999"),
    (["--env.train", '[{"name": "sokoban", "groups": 2048, "group_size": 4096}]', "--env.env_groups", "2048"],
     "env.train[0]: 2048 groups x group_size 4096 = 8388608 episodes; a split runs at most 4194304"),
], ids=["val_zero", "val_huge", "train_negative", "size_zero", "product", "entries_total", "entry_groups",
        "entry_product"])
def test_group_counts_are_bounded_before_anything_is_allocated(args, words):
    """env.val_groups 99999999999 built a list of 10^11 group ids (OOM-killed); 0 gave 'min() arg is an empty
    sequence' in fastpo.eval. Each is one line with the range, from the one place both train and eval resolve."""
    import time

    start = time.perf_counter()
    msg = _errors(parse_args(["--preset", "tiny", *args]))
    lines = [x for x in msg.splitlines()[1:] if x.strip()]
    assert len(lines) == 1 and words in lines[0], msg
    assert time.perf_counter() - start < 10
