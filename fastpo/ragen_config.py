"""Port a RAGEN (Hydra) YAML to the equivalent fastpo YAML.

    python -m fastpo.ragen_config config/_2_sokoban.yaml > sokoban.yaml      # then: python -m fastpo.train --config
    python -m fastpo.ragen_config my.yaml --ignore trainer.default_local_dir  # skip a key that has no mapping

The file's ``defaults`` (``base``, ``envs``, ...) are read from the same folder and merged first, Hydra-style
(later files and the file itself win); verl's ``ppo_trainer`` defaults are not ported (fastpo's defaults equal
RAGEN's where RAGEN sets them; docs/RAGEN.md). ``${a.b}`` interpolations are resolved (one naming a key that
is not in the merged files, e.g. a verl default, stays as written). Every RAGEN key a user
sets is either mapped to a fastpo field (the table ``KEY_MAP``), listed as a comment when it has no effect here
(``INERT``: e.g. micro-batch sizes, which fastpo replaces with token budgets), or refused with an error naming
it (``--ignore KEY`` skips a key or a whole subtree). ``es_manager.train`` / ``val`` with their ``tags`` and
``n_groups`` become ``env.train`` / ``env.val`` entries, each with the tag's ``custom_envs`` settings
(``env_type``, ``env_config``, ``max_actions_per_traj``) and the tag as its label. ``port`` is the library
entry; the output is checked with fastpo's own config before it is printed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import prompts
from .cli import Positional


class PortError(ValueError):
    """RAGEN keys that cannot be mapped; the message names every one of them."""


# RAGEN env_type -> fastpo env name.
ENV_TYPES = {"sokoban": "sokoban", "frozen_lake": "frozenlake", "bandit": "bandit", "countdown": "countdown",
             "metamathqa": "metamathqa"}
_INSTRUCTIONS = {"sokoban": prompts.SOKOBAN_INSTRUCTION, "frozenlake": prompts.FROZENLAKE_INSTRUCTION,
                 "bandit": "", "countdown": prompts.COUNTDOWN_INSTRUCTION,
                 "metamathqa": prompts.METAMATHQA_INSTRUCTION}

# RAGEN's config/envs.yaml tags, used when the YAML's defaults do not bring custom_envs along.
STOCK_TAGS: dict[str, dict[str, Any]] = {
    "SimpleSokoban": {"env_type": "sokoban", "max_actions_per_traj": 10,
                      "env_config": {"dim_x": 6, "dim_y": 6, "num_boxes": 1, "max_steps": 100}},
    "LargerSokoban": {"env_type": "sokoban", "max_actions_per_traj": 10,
                      "env_config": {"dim_x": 8, "dim_y": 8, "num_boxes": 2, "max_steps": 100, "search_depth": 10}},
    "SokobanDifferentGridVocab": {"env_type": "sokoban", "max_actions_per_traj": 10, "env_config": {
        "search_depth": 30, "dim_x": 6, "dim_y": 6, "num_boxes": 1, "max_steps": 100,
        "grid_lookup": {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}}},
    "Countdown": {"env_type": "countdown", "max_actions_per_traj": 1, "env_config": None},
    "Bandit": {"env_type": "bandit", "max_actions_per_traj": 1,
               "env_config": {"lo_arm_name": "Phoenix", "hi_arm_name": "Dragon"}},
    "BanditTest": {"env_type": "bandit", "max_actions_per_traj": 1,
                   "env_config": {"lo_arm_name": "Trader", "hi_arm_name": "Librarian"}},
    "FrozenLake": {"env_type": "frozen_lake", "max_actions_per_traj": 10, "env_config": None},
    "MetamathQA": {"env_type": "metamathqa", "max_actions_per_traj": 1, "env_config": None},
}

_ALT_GRID = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}
_DEFAULT_GRID = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}


def _estimator(v: Any) -> str:
    table = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp"}
    if v not in table:
        raise ValueError(f"no fastpo estimator for {v!r}; fastpo has {sorted(table)}")
    return table[v]


def _kl_type(v: Any) -> str:
    table = {"kl": "k1", "k1": "k1", "low_var_kl": "k3", "k3": "k3"}
    if v not in table:
        raise ValueError(f"no fastpo KL estimator for {v!r}; fastpo has kl (k1) and low_var_kl (k3)")
    return table[v]


def _save_every(v: Any) -> int:
    return 0 if int(v) < 0 else int(v)


def _must_equal(expected: Any, why: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v != expected:
            raise ValueError(f"only {expected!r} is supported: {why}")
    return check


def _adjust_mode(v: Any) -> str:
    if v not in ("copy", "delete"):
        raise ValueError("accepted: copy, delete")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("expected true or false")
    return v


#: RAGEN key -> (fastpo field, conversion). A conversion returning None with field None is a pure check.
KEY_MAP: dict[str, tuple[str | None, Callable[[Any], Any]]] = {
    "model_path": ("model.path", str),
    "actor_rollout_ref.model.path": ("model.path", str),
    "critic.model.path": ("model.critic_path", str),
    "lora.rank": ("model.lora_rank", int),
    "lora.alpha": ("model.lora_alpha", int),
    "lora.target_modules": ("model.lora_target_modules", str),
    "actor_rollout_ref.model.lora_rank": ("model.lora_rank", int),
    "actor_rollout_ref.model.lora_alpha": ("model.lora_alpha", int),
    "actor_rollout_ref.model.target_modules": ("model.lora_target_modules", str),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", bool),
    "seed.train": ("env.train_seed", int),
    "seed.val": ("env.val_seed", int),
    "ppo_mini_batch_size": ("optim.mini_batch_size", int),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("optim.mini_batch_size", int),
    "actor_rollout_ref.actor.ppo_epochs": ("optim.ppo_epochs", int),
    "actor_rollout_ref.actor.grad_clip": ("optim.grad_clip", float),
    "actor_rollout_ref.actor.entropy_coeff": ("algorithm.entropy_coef", float),
    "actor_rollout_ref.actor.kl_loss_coef": ("algorithm.kl_coef", float),
    "actor_rollout_ref.actor.kl_loss_type": ("algorithm.kl_type", _kl_type),
    "actor_rollout_ref.actor.clip_ratio_low": ("algorithm.eps_low", float),
    "actor_rollout_ref.actor.clip_ratio_high": ("algorithm.eps_high", float),
    "actor_rollout_ref.actor.clip_ratio_c": ("algorithm.clip_c", float),
    "actor_rollout_ref.actor.loss_agg_mode": ("algorithm.loss_agg_mode", str),
    "actor_rollout_ref.actor.optim.lr": ("optim.actor_lr", float),
    "actor_rollout_ref.actor.optim.betas": ("optim.betas", list),
    "actor_rollout_ref.actor.optim.weight_decay": ("optim.weight_decay", float),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("optim.warmup_steps", lambda v: max(int(v), 0)),
    "critic.optim.lr": ("optim.critic_lr", float),
    "critic.cliprange_value": ("algorithm.value_clip", float),
    "actor_rollout_ref.rollout.max_model_len": ("rollout.max_model_len", int),
    "actor_rollout_ref.rollout.response_length": ("rollout.response_length", int),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", float),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", float),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", int),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.gpu_memory_utilization", float),
    "actor_rollout_ref.rollout.rollout_filter_ratio": ("algorithm.rollout_filter_ratio", float),
    "actor_rollout_ref.rollout.rollout_filter_type": ("algorithm.rollout_filter_type", str),
    "actor_rollout_ref.rollout.rollout_filter_strategy": ("algorithm.rollout_filter_strategy", str),
    "actor_rollout_ref.rollout.rollout_filter_value": ("algorithm.rollout_filter_value", float),
    "actor_rollout_ref.rollout.rollout_filter_metric": ("algorithm.rollout_filter_metric", str),
    "actor_rollout_ref.rollout.rollout_filter_include_zero": ("algorithm.rollout_filter_include_zero", bool),
    "actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode": ("algorithm.rollout_filter_top_p_prob_mode", str),
    "actor_rollout_ref.rollout.rollout_filter_selection_eps": ("algorithm.rollout_filter_selection_eps", float),
    "actor_rollout_ref.rollout.rollout_filter_empty_stop_steps": ("algorithm.rollout_filter_empty_stop_steps", int),
    "actor_rollout_ref.actor.filter_loss_scaling": ("algorithm.filter_loss_scaling", str),
    "actor_rollout_ref.rollout.val_kwargs.temperature": ("rollout.val_temperature", float),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (None, _must_equal(1, "fastpo's vLLM runs TP 1")),
    "enable_response_mask": ("rollout.train_on_observations", lambda v: not bool(v)),
    "grpo_advantage_length_weight": ("algorithm.grpo_length_weight", _bool),
    "actor_rollout_ref.actor.grpo_advantage_length_weight": ("algorithm.grpo_length_weight", _bool),
    "algorithm.zero_task_advantage": ("algorithm.zero_task_advantage", _bool),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", _bool),
    "algorithm.soft_advantage_reweight": ("algorithm.soft_advantage_reweight", _bool),
    "agent_proxy.context_window_mode": (None, _must_equal(
        "full", "fastpo trains on the whole multi-turn conversation; single_turn and limited_multi_turn (one "
        "training sequence per turn) are not implemented")),
    "trainer.generations_to_log_to_wandb.val": ("trainer.log_generations", lambda v: max(int(v), 0)),
    "agent_proxy.batch_adjust_mode": ("algorithm.batch_adjust_mode", _adjust_mode),
    "algorithm.gamma": ("algorithm.gamma", float),
    "algorithm.lam": ("algorithm.lam", float),
    "algorithm.high_level_gamma": ("algorithm.gamma_high", float),
    "algorithm.adv_estimator": ("algorithm.adv_estimator", _estimator),
    "algorithm.kl_ctrl.kl_coef": (None, _must_equal(0.0, "fastpo has no KL penalty inside the reward (use "
                                                        "actor_rollout_ref.actor.kl_loss_coef)")),
    "trainer.project_name": ("trainer.wandb_project", str),
    "trainer.experiment_name": ("trainer.run_dir", lambda v: f"runs/{v}"),
    "trainer.save_freq": ("trainer.save_every", _save_every),
    "trainer.total_training_steps": ("trainer.iterations", int),
    "trainer.val_before_train": ("trainer.val_before_train", bool),
    "trainer.test_freq": ("trainer.val_every", lambda v: max(int(v), 0)),
    "trainer.validation_steps": (None, _must_equal(1, "fastpo validates val_groups x val_group_size once")),
    "trainer.logger": ("trainer.log_wandb", lambda v: "wandb" in (v if isinstance(v, list) else [v])),
    "agent_proxy.max_context_window": ("rollout.max_context_window", lambda v: -1 if int(v) <= 0 else int(v)),
    "agent_proxy.max_turn": ("env.max_turns", int),
    "agent_proxy.action_sep": ("env.action_sep", str),
    "agent_proxy.max_actions_per_turn": ("env.max_actions_per_turn", int),
    "agent_proxy.use_turn_scores": ("rollout.reward_level", lambda v: "turn" if v else "trajectory"),
    "agent_proxy.enable_think": ("rollout.enable_think", bool),
    "agent_proxy.reward_normalization.method": (None, _must_equal(
        "identity", "fastpo passes the scores to the advantage estimator as they are (RAGEN's identity); "
        "RAGEN's mean_std / asym_clip score normalisation has no fastpo option (grpo's own baseline: "
        "algorithm.grpo_norm)")),
    "es_manager.format_penalty": ("rollout.format_penalty", float),
    "es_manager.train.env_groups": ("env.env_groups", int),
    "es_manager.train.group_size": ("env.group_size", int),
    "es_manager.val.env_groups": ("env.val_groups", int),
    "es_manager.val.group_size": ("env.val_group_size", int),
}

#: RAGEN keys with no effect in fastpo (listed as comments in the output), with the reason.
INERT: dict[str, str] = {
    "micro_batch_size_per_gpu": "fastpo sizes micro-batches by tokens (optim.micro_batch_tokens)",
    "log_prob_micro_batch_size_per_gpu": "token-budget micro-batches (optim.micro_batch_tokens)",
    "actor_rollout_ref.rollout.name": "RAGEN's generation engine; fastpo's is rollout.engine (hf, its built-in "
                                      "engine, by default; vllm where installed)",
    "actor_rollout_ref.rollout.load_format": "how vLLM loads weights; fastpo's engine takes the actor's weights",
    "hydra.searchpath": "where Hydra finds verl's default files; fastpo does not read them (docs/RAGEN.md)",
    "actor_rollout_ref.actor.micro_batch_size_per_gpu": "token-budget micro-batches (optim.micro_batch_tokens)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "token-budget micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "token-budget micro-batches",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "token-budget micro-batches",
    "critic.ppo_micro_batch_size_per_gpu": "token-budget micro-batches",
    "critic.ppo_mini_batch_size": "the critic steps on the actor's mini-batches (optim.mini_batch_size)",
    "critic.model.lora_rank": "the critic uses model.lora_rank", "critic.model.lora_alpha": "model.lora_alpha",
    "critic.model.target_modules": "model.lora_target_modules",
    "critic.optim.betas": "optim.betas serves actor and critic",
    "actor_rollout_ref.actor.use_ref": "the reference model is loaded only when algorithm.kl_coef > 0",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef > 0 turns the KL loss on",
    "actor_rollout_ref.rollout.prompt_length": "unused by RAGEN too",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM scheduler setting, not exposed",
    "actor_rollout_ref.rollout.enforce_eager": "vLLM setting, not exposed",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM sleeps during the update on GPU",
    "actor_rollout_ref.rollout.tp_size_check": "TP is 1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "validation samples at rollout.val_temperature (0 = greedy)",
    "algorithm.bi_level_gae": "mapped with algorithm.adv_estimator (true -> bilevel_gae)",
    "algorithm.kl_penalty": "no in-reward KL (algorithm.kl_ctrl.kl_coef must be 0)",
    "algorithm.kl_ctrl.type": "no in-reward KL",
    "agent_proxy.reward_normalization.grouping": "no effect with method identity",
    "system.CUDA_VISIBLE_DEVICES": "choose GPUs with CUDA_VISIBLE_DEVICES / torchrun",
    "trainer.n_gpus_per_node": "launch with torchrun --nproc_per_node N",
    "trainer.local_log_dir": "logs go to trainer.run_dir",
    "trainer.wandb_id": "fastpo resumes the W&B run whose id it keeps in <run_dir>/wandb_run_id; a run id from "
                        "the config is not read",
    "trainer.generations_to_log_to_wandb.train": "fastpo logs validation generations only (trainer.log_generations)",
    "data.max_prompt_length": "unused", "data.max_response_length": "unused", "data.train_batch_size": "unused",
    "ctx_manager.generation.gen_config.response_length": "= rollout.response_length",
    "ctx_manager.generation.gen_config.temperature": "= rollout.temperature",
    "ctx_manager.generation.gen_config.top_p": "= rollout.top_p", "ctx_manager.generation.gen_config.top_k":
        "= rollout.top_k", "ctx_manager.generation.gen_config.kwargs": "unused",
}

# ---- RAGEN-2's diagnostics and checkpoint counts: fastpo's side is being added. One table, so that each entry
# moves to KEY_MAP (or INERT) when its fastpo field exists.
#: RAGEN key -> (values ported as a note because they leave the training unchanged, or None for any value; what
#: fastpo does not do). Another value is refused, naming the key, the value and the accepted values.
NOT_PORTED_YET: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    **{f"collapse_detection.{k}": (None, "RAGEN-2's collapse-detection metrics (mutual-information proxies) are not "
                                         "computed by fastpo")
       for k in ("compute_freq", "micro_batch_size", "first_turn_enabled", "multi_turn_enabled", "num_samples")},
    **{k: ((False,), "gradient analysis by reward-variance bucket is not implemented in fastpo")
       for k in ("trainer.gradient_analysis_mode", "trainer.gradient_analysis_only",
                 "trainer.exit_after_gradient_analysis")},
    **{k: (None, "gradient analysis by reward-variance bucket is not implemented in fastpo")
       for k in ("trainer.gradient_analysis_every", "trainer.gradient_analysis_env_groups",
                 "trainer.gradient_analysis_group_size", "trainer.gradient_analysis_log_prefilter",
                 "actor_rollout_ref.rollout.gradient_analysis_num_buckets",
                 "actor_rollout_ref.rollout.gradient_analysis_bucket_mode")},
    "trainer.log_group_rv_table": ((False,), "the per-group reward-variance table is not logged by fastpo"),
    **{k: (None, "RAGEN's checkpoint count is not ported; fastpo keeps the last trainer.keep_last checkpoints "
                 "(default 2)") for k in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep")},
}

#: Paper-time (April 2025) LoRA switches: ``lora.enabled`` and the per-role copies of the ``lora`` block.
_LORA_ROLES = ("actor_rollout_ref.actor.lora", "actor_rollout_ref.rollout.lora", "critic.lora")
_LORA_FIELDS = {"rank": "model.lora_rank", "alpha": "model.lora_alpha", "target_modules": "model.lora_target_modules"}

#: Top-level keys of RAGEN's configs (a --config with one of them as a section is a RAGEN file, not a fastpo one).
RAGEN_SECTIONS = frozenset(k.split(".")[0] for k in (*KEY_MAP, *INERT, *NOT_PORTED_YET) if "." in k)


def ragen_equivalents(name: str) -> tuple[str, list[str]]:
    """(RAGEN's name, the fastpo fields it maps to) for a setting spelled RAGEN's way: a full RAGEN key
    (``actor_rollout_ref.actor.clip_ratio_low``) or its last part under any section (``algorithm.clip_ratio_low``,
    ``clip_ratio_low``), looked up in :data:`KEY_MAP`; ``(name, [])`` when it is not a RAGEN name."""
    key = name.lstrip("-")
    short = key.rsplit(".", 1)[-1]
    if key in KEY_MAP:
        fields = [KEY_MAP[key][0]]
    else:
        fields = [f for k, (f, _) in KEY_MAP.items() if k.rsplit(".", 1)[-1] == short]
    return short, sorted({f for f in fields if f})


_ENV_CONFIG_KEYS = {  # per fastpo env: RAGEN env_config key -> fastpo kwargs key (None: checked separately)
    "sokoban": {"num_boxes": "num_boxes", "max_steps": "max_steps", "search_depth": "search_depth",
                "dim_room": "dim_room", "dim_x": None, "dim_y": None, "grid_lookup": None, "grid_vocab": None,
                "render_mode": None, "action_lookup": None, "observation_format": "observation_format"},
    "frozenlake": {"size": "size", "p": "p", "is_slippery": "is_slippery", "max_steps": "max_steps",
                   "render_mode": None, "grid_lookup": None, "grid_vocab": None, "action_lookup": None,
                   "map_seed": None, "action_map": None, "map_lookup": None,
                   "observation_format": "observation_format", "success_rate": "success_rate"},
    "bandit": {"lo_arm_name": "lo_arm_name", "hi_arm_name": "hi_arm_name", "lo_arm_score": "lo_arm_score",
               "hi_arm_loscore": "hi_arm_loscore", "hi_arm_hiscore": "hi_arm_hiscore",
               "hi_arm_hiscore_prob": "hi_arm_hiscore_prob", "render_mode": None, "action_space_start": None,
               "action_lookup": None, "split": "split"},
    "countdown": {"max_instances": "max_instances", "render_mode": None, "train_path": None},
    "metamathqa": {"dataset_path": None, "split": None, "dataset": None},
}


# ------------------------------------------------------------------------------------------------ loading
def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_ragen_yaml(path: str | Path) -> dict[str, Any]:
    """A RAGEN YAML with its ``defaults`` merged in (sibling ``<name>.yaml`` files, recursively; ``ppo_trainer``
    skipped) and ``${a.b}`` interpolations resolved. Raises PortError naming a missing, unreadable, binary, too deep
    or too big file (``fastpo.config_io.load_yaml``)."""
    from .config_io import load_yaml

    def load(p: Path, seen: tuple[Path, ...]) -> dict:
        if p in seen:
            raise PortError(f"{p}: defaults form a cycle through {[str(s) for s in seen]}")
        try:
            data = load_yaml(p.read_text(), str(p)) or {}
        except OSError as e:
            raise PortError(f"cannot read RAGEN config {str(p)!r}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise PortError(f"{p} is not a text file (a RAGEN YAML is expected)") from None
        except ValueError as e:
            raise PortError(str(e)) from None
        if not isinstance(data, dict):
            raise PortError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
        merged: dict = {}
        for name in data.pop("defaults", None) or []:
            if not isinstance(name, str) or name in ("ppo_trainer", "_self_"):
                continue
            sibling = p.parent / f"{name}.yaml"
            if not sibling.is_file():
                raise PortError(f"{p}: defaults entry {name!r} needs {sibling}, which does not exist")
            merged = _merge(merged, load(sibling, (*seen, p)))
        return _merge(merged, data)

    return _interpolate(load(Path(path), ()))


_MISSING = object()


def _lookup(root: dict, dotted: str) -> Any:
    node: Any = root
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING  # e.g. a verl ppo_trainer default: the text stays as written
        node = node[part]
    return node


def _interpolate(root: dict) -> dict:
    from .config_io import MAX_NODES

    pattern = re.compile(r"\$\{([^}]+)\}")
    budget = [MAX_NODES]  # values produced: each ${...} copies what it names, so chains of them multiply

    def resolve(value: Any, depth: int = 0) -> Any:
        if depth > 20:
            raise PortError("interpolations nest more than 20 levels (a cycle?)")
        budget[0] -= 1 + (len(value) // 100 if isinstance(value, str) else 0)
        if budget[0] < 0:
            raise PortError(f"${{...}} interpolations expand the config past {MAX_NODES} values; a RAGEN config "
                            f"has a few hundred")
        if isinstance(value, dict):
            return {k: resolve(v, depth) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, depth) for v in value]
        if isinstance(value, str):
            whole = pattern.fullmatch(value.strip())
            if whole:
                found = _lookup(root, whole.group(1))
                return value if found is _MISSING else resolve(found, depth + 1)

            def sub(m: re.Match) -> str:
                found = _lookup(root, m.group(1))
                return m.group(0) if found is _MISSING else str(resolve(found, depth + 1))

            if pattern.search(value):
                return pattern.sub(sub, value)
        return value

    return resolve(root)


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# ----------------------------------------------------------------------------------------------- porting
def _ignored(key: str, ignore: Sequence[str]) -> bool:
    return any(key == i or key.startswith(i + ".") for i in ignore)


def _set(out: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".", 1)
    out.setdefault(section, {})[key] = value


def _port_env_config(tag: str, name: str, config: Any, ignore: Sequence[str], errors: list[str],
                     notes: list[str]) -> dict[str, Any]:
    at = f"custom_envs.{tag}.env_config"
    kwargs: dict[str, Any] = {}
    if config is None:
        return kwargs
    if not isinstance(config, dict):
        errors.append(f"{at}: expected a mapping, got {config!r}")
        return kwargs
    table = _ENV_CONFIG_KEYS[name]
    for key, value in config.items():
        if _ignored(f"{at}.{key}", ignore):
            continue
        if key not in table:
            errors.append(f"{at}.{key}: no fastpo {name} config key for it (accepted: {sorted(table)})")
        elif table[key] is not None:
            kwargs[table[key]] = list(value) if isinstance(value, tuple) else value
        elif key in ("dim_x", "dim_y"):
            kwargs["dim_room"] = [config.get("dim_x", 6), config.get("dim_y", 6)]
        elif key == "grid_lookup":
            lookup = {int(k): v for k, v in value.items()} if isinstance(value, dict) else value
            if lookup == _ALT_GRID:
                kwargs["symbols"] = "different"
            elif lookup != _DEFAULT_GRID:
                errors.append(f"{at}.grid_lookup: fastpo draws Sokoban in the default or RAGEN's alternative "
                              f"symbols only, got {value!r}")
        elif key == "grid_vocab":
            notes.append(f"{at}.grid_vocab: RAGEN never shows a nested grid_vocab in the prompt; neither does fastpo")
        elif key == "render_mode":
            if value != "text":
                errors.append(f"{at}.render_mode: fastpo renders text only, got {value!r}")
        elif key == "map_seed":
            if value is not None:
                errors.append(f"{at}.map_seed: fastpo draws each map from the episode seed; a fixed map_seed has no "
                              "equivalent")
        elif key == "action_space_start":
            if value != 1:
                errors.append(f"{at}.action_space_start: fastpo's Bandit ids start at 1, got {value!r}")
        elif key in ("train_path", "dataset_path", "split", "dataset"):
            notes.append(f"{at}.{key}={value!r}: fastpo reads a local JSONL / JSON file: add kwargs.data_path to the "
                         f"{tag} entry (docs/ENVS.md)")
        else:
            notes.append(f"{at}.{key}: RAGEN's default lookup table; fastpo uses the same")
    return kwargs


def _port_env_list(split: str, manager: dict, custom: dict, ignore: Sequence[str], errors: list[str],
                   notes: list[str]) -> list[dict[str, Any]] | None:
    configs = manager.get("env_configs") or {}
    tags, n_groups = configs.get("tags"), configs.get("n_groups")
    if tags is None:
        return None
    if not isinstance(tags, list) or not tags:
        errors.append(f"es_manager.{split}.env_configs.tags: expected a non-empty list, got {tags!r}")
        return None
    if n_groups is not None and (not isinstance(n_groups, list) or len(n_groups) != len(tags)):
        errors.append(f"es_manager.{split}.env_configs.n_groups: expected one count per tag ({len(tags)}), got "
                      f"{n_groups!r}")
        n_groups = None
    entries = []
    for i, tag in enumerate(tags):
        spec = custom.get(tag, STOCK_TAGS.get(tag))
        if spec is None:
            errors.append(f"es_manager.{split}.env_configs.tags[{i}]: tag {tag!r} has no custom_envs entry")
            continue
        env_type = spec.get("env_type")
        if env_type not in ENV_TYPES:
            errors.append(f"custom_envs.{tag}.env_type: no fastpo env for {env_type!r}; fastpo has "
                          f"{sorted(ENV_TYPES)} (add your own with --env.plugins, docs/ENVS.md)")
            continue
        name = ENV_TYPES[env_type]
        entry: dict[str, Any] = {"name": name, "label": tag}
        if n_groups is not None:
            entry["groups"] = int(n_groups[i])
        for key, value in spec.items():
            at = f"custom_envs.{tag}.{key}"
            if key in ("env_type", "env_config") or _ignored(at, ignore):
                continue
            if key == "max_actions_per_traj":
                entry["max_actions_per_traj"] = int(value)
            elif key == "max_tokens":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    errors.append(f"{at}={value!r}: the 'Max response length' number must be an int >= 1")
                elif value != 100:
                    entry.setdefault("prompt", {})["max_tokens"] = value
            elif key == "env_instruction":
                if not isinstance(value, str):
                    errors.append(f"{at}={value!r}: the instruction must be a string")
                elif value != _INSTRUCTIONS[name]:
                    entry.setdefault("prompt", {})["env_instruction"] = value
            elif key in ("parallel_friendly", "max_workers"):
                notes.append(f"{at}={value!r}: no effect in fastpo (RAGEN's thread pool for stepping Python envs; "
                             f"fastpo steps each env as one batch)")
            else:
                errors.append(f"{at}: no fastpo equivalent")
        kwargs = _port_env_config(tag, name, spec.get("env_config"), ignore, errors, notes)
        if kwargs:
            entry["kwargs"] = kwargs
        entries.append(entry)
    return entries


def port(ragen: dict[str, Any], ignore: Sequence[str] = ()) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Map a merged RAGEN config (``load_ragen_yaml``) to fastpo's nested ``{section: {field: value}}``.

    Returns ``(config, notes)``: notes are the comment lines (inert keys and caveats). Raises PortError listing
    every key that cannot be mapped (``ignore``: keys or subtrees to skip)."""
    out: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    notes: list[str] = []
    custom = ragen.get("custom_envs") or {}
    flat = _flatten({k: v for k, v in ragen.items() if k not in ("custom_envs", "es_manager")})
    manager = ragen.get("es_manager") or {}
    flat.update({f"es_manager.{k}": v for k, v in _flatten(manager).items() if ".env_configs." not in f".{k}."})
    bi_level = bool(flat.get("algorithm.bi_level_gae", False))
    handled = _port_lora({k: v for k, v in flat.items() if not _ignored(k, ignore)}, out, errors, notes)
    for key, value in flat.items():
        if _ignored(key, ignore) or key in handled:
            continue
        if key in NOT_PORTED_YET:
            accepted, why = NOT_PORTED_YET[key]
            if accepted is None or any(type(value) is type(a) and value == a for a in accepted):
                notes.append(f"{key}={value!r}: not ported ({why})")
            else:
                errors.append(f"{key}={value!r}: {why}; accepted: {', '.join(repr(a) for a in accepted)}")
            continue
        if key in INERT:
            notes.append(f"{key}={value!r}: no effect in fastpo ({INERT[key]})")
            continue
        if key not in KEY_MAP:
            errors.append(f"{key}: no fastpo equivalent (pass --ignore {key} to skip it)")
            continue
        target, convert = KEY_MAP[key]
        try:
            converted = convert(value)
        except (TypeError, ValueError) as e:
            errors.append(f"{key}={value!r}: {e}")
            continue
        if target is not None:
            _set(out, target, converted)
    model = out.get("model", {})
    if "critic_path" in model and model["critic_path"] == model.get("path", model["critic_path"]):
        del model["critic_path"]  # RAGEN's critic is the policy's checkpoint: fastpo's "" (same as model.path)
    if bi_level and out.get("algorithm", {}).get("adv_estimator", "gae") == "gae":
        _set(out, "algorithm.adv_estimator", "bilevel_gae")
    for split, field in (("train", "env.train"), ("val", "env.val")):
        if isinstance(manager.get(split), dict) and not _ignored(f"es_manager.{split}.env_configs", ignore):
            entries = _port_env_list(split, manager[split], custom, ignore, errors, notes)
            if entries is not None:
                _set(out, field, entries)
    _port_filter(out.get("algorithm", {}), notes)
    alg = out.get("algorithm", {})
    for key in ("soft_advantage_reweight", "grpo_length_weight"):  # RAGEN applies them to GRPO only
        if alg.get(key) and alg.get("adv_estimator", "gae") != "grpo":
            del alg[key]
            notes.append(f"algorithm.{key}: no effect with adv_estimator {alg.get('adv_estimator', 'gae')!r} (RAGEN "
                         f"applies it to GRPO only); not set")
    if out.get("algorithm", {}).get("adv_estimator") == "grpo":
        notes.append("algorithm.adv_estimator=grpo: fastpo standardises each trajectory's return within its group of "
                     "group_size; RAGEN's code gives every trajectory its own group (docs/RAGEN.md)")
    if errors:
        raise PortError("cannot port these RAGEN keys:\n  " + "\n  ".join(dict.fromkeys(errors)))
    return out, list(dict.fromkeys(notes))  # a tag used for training and validation is read twice


def _port_lora(flat: dict[str, Any], out: dict, errors: list[str], notes: list[str]) -> set[str]:
    """The paper-time ``lora`` block: ``lora.enabled`` false means no LoRA whatever its rank (fastpo's
    model.lora_rank 0); its per-role copies (actor, rollout, critic) must agree with it, as fastpo has one LoRA
    setting for all three. Returns the keys handled here (the rest go through KEY_MAP)."""
    role_keys = [k for k in flat if any(k.startswith(r + ".") for r in _LORA_ROLES)]
    if "lora.enabled" not in flat and not role_keys:
        return set()
    handled = {"lora.enabled", "lora.local_temp_dir", *role_keys}
    enabled = flat.get("lora.enabled", True)
    if not isinstance(enabled, bool):
        errors.append(f"lora.enabled={enabled!r}: expected true or false")
        return handled
    if not enabled:
        handled |= {f"lora.{f}" for f in _LORA_FIELDS}
        _set(out, "model.lora_rank", 0)
        notes.extend(f"{k}={flat[k]!r}: no effect (lora.enabled is false: full fine-tuning, model.lora_rank 0)"
                     for k in sorted(handled) if k in flat and k != "lora.enabled")
        return handled
    for key in role_keys:
        field = key.rsplit(".", 1)[-1]
        top = flat.get(f"lora.{field}", flat[key])
        if field == "local_temp_dir":
            notes.append(f"{key}={flat[key]!r}: no effect (RAGEN's scratch folder for handing adapters to vLLM)")
        elif field not in (*_LORA_FIELDS, "enabled"):
            errors.append(f"{key}: no fastpo equivalent (accepted: enabled, {', '.join(_LORA_FIELDS)}, local_temp_dir)")
        elif flat[key] != top:
            errors.append(f"{key}={flat[key]!r}: fastpo uses one LoRA setting for actor, rollout and critic; "
                          f"accepted: lora.{field}'s value {top!r}")
        elif field in _LORA_FIELDS and f"lora.{field}" not in flat:
            _set(out, _LORA_FIELDS[field], KEY_MAP[f"lora.{field}"][1](flat[key]))
    if "lora.local_temp_dir" in flat:
        notes.append(f"lora.local_temp_dir={flat['lora.local_temp_dir']!r}: no effect (RAGEN's scratch folder for "
                     f"handing adapters to vLLM)")
    return handled


def _port_filter(alg: dict[str, Any], notes: list[str]) -> None:
    """RAGEN's rollout_filter_type largest / smallest is a direction (RAGEN-2's family, and its pre-2 filter: the
    int(ratio x G) groups by the metric, i.e. top_k with value = ratio); std / std_rev / nonzero are fastpo's legacy
    filter names. RAGEN-2 reads rollout_filter_value and falls back to rollout_filter_ratio when it is missing."""
    kind = alg.get("rollout_filter_type")
    if kind in ("largest", "smallest"):
        alg["rollout_filter_direction"] = alg.pop("rollout_filter_type")
        if alg.get("rollout_filter_strategy", "legacy") == "legacy":
            alg["rollout_filter_strategy"] = "top_k"
            alg.setdefault("rollout_filter_value", alg.get("rollout_filter_ratio", 0.25))
    if alg.get("rollout_filter_strategy", "legacy") != "legacy":
        if "rollout_filter_ratio" in alg:
            ratio = alg.pop("rollout_filter_ratio")
            if "rollout_filter_value" in alg:
                notes.append(f"rollout_filter_ratio={ratio!r}: not used by RAGEN-2's filter (rollout_filter_value "
                             f"decides)")
            else:
                alg["rollout_filter_value"] = ratio


def to_yaml(config: dict[str, dict[str, Any]], notes: Sequence[str], source: str = "") -> str:
    """The fastpo YAML text: a comment header (source and notes), then the sections."""
    import yaml

    head = [f"# fastpo config ported from RAGEN's {source} by python -m fastpo.ragen_config" if source else
            "# fastpo config ported from a RAGEN config by python -m fastpo.ragen_config"]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


@dataclass
class PortArgs:
    """``python -m fastpo.ragen_config RAGEN.yaml``."""

    path: Positional[str] = ""
    """A RAGEN YAML (e.g. config/_2_sokoban.yaml); its defaults are read from its folder."""
    ignore: tuple[str, ...] = ()
    """RAGEN keys (dotted) or subtrees to skip instead of refusing them."""
    out: str = ""
    """Write the YAML here instead of printing it."""


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: print the ported YAML (exit 0) or one ``error:`` message naming the unmapped keys (exit 2)."""
    from .cli import describe, parse
    from .config import Config, ConfigError, merge, validate

    try:
        args = parse(PortArgs, argv, prog="python -m fastpo.ragen_config",
                     description=describe(__doc__.split("\n\n")[0]))
        if not args.path:
            raise ConfigError("give the RAGEN YAML to port (e.g. config/_2_sokoban.yaml)")
        config, notes = port(load_ragen_yaml(args.path), list(args.ignore))
        cfg = merge(Config(), config, source="ported config")
        try:
            validate(cfg)
        except ConfigError as err:  # e.g. MetamathQA without a data file: printed, for the user to complete
            notes = [*notes, *(f"fastpo's config check: {line.strip()}" for line in str(err).splitlines()[1:])]
    except (PortError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = to_yaml(config, notes, args.path)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
