"""Port a RAGEN (Hydra) YAML to the equivalent fastpo YAML.

    python -m fastpo.ragen_config config/_2_sokoban.yaml > sokoban.yaml      # then: python -m fastpo.train --config
    python -m fastpo.ragen_config my.yaml --ignore trainer.default_local_dir  # skip a key that has no mapping

The file's ``defaults`` (``base``, ``envs``, ...) are read from the same folder and merged first, Hydra-style
(later files and the file itself win); verl's ``ppo_trainer`` defaults are not ported (fastpo's defaults equal
RAGEN's where RAGEN sets them; docs/RAGEN.md). ``${a.b}`` interpolations are resolved (one naming a key that
is not in the merged files, e.g. a verl default, stays as written). Every RAGEN key a user sets is either
mapped to a fastpo field (the table ``KEY_MAP``, in ``fastpo.ragen_keys``), listed as a comment when it has no
effect here (``INERT``: e.g. micro-batch sizes, which fastpo replaces with token budgets), or refused with an
error naming it (``--ignore KEY`` skips a key or a whole subtree). ``es_manager.train`` / ``val`` with their
``tags`` and ``n_groups`` become ``env.train`` / ``env.val`` entries, each with the tag's ``custom_envs`` settings
(``env_type``, ``env_config``, ``max_actions_per_traj``) and the tag as its label. ``port`` is the library
entry; the output is checked with fastpo's own config before it is printed.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import prompts
from .cli import Positional
from .ragen_keys import INERT, KEY_MAP, _keep_checkpoints


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


#: Paper-time (April 2025) LoRA switches: ``lora.enabled`` and the per-role copies of the ``lora`` block.
_LORA_ROLES = ("actor_rollout_ref.actor.lora", "actor_rollout_ref.rollout.lora", "critic.lora")
_LORA_FIELDS = {"rank": "model.lora_rank", "alpha": "model.lora_alpha", "target_modules": "model.lora_target_modules"}

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
    from .config_io import load_yaml_file

    def load(p: Path, seen: tuple[Path, ...]) -> dict:
        if p in seen:
            raise PortError(f"{p}: defaults form a cycle through {[str(s) for s in seen]}")
        try:
            data = load_yaml_file(p, f"RAGEN config {str(p)!r}", "a RAGEN YAML") or {}
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
    keeps = {k: flat[k] for k in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep") if k in flat}
    with contextlib.suppress(TypeError, ValueError):  # a bad value is refused by its own line below
        if len(keeps) == 2 and len({_keep_checkpoints(v) for v in keeps.values()}) == 2:
            errors.append(f"trainer.max_critic_ckpt_to_keep={keeps['trainer.max_critic_ckpt_to_keep']!r}: accepted: "
                          f"the value of trainer.max_actor_ckpt_to_keep ({keeps['trainer.max_actor_ckpt_to_keep']!r}); "
                          f"a fastpo checkpoint holds actor and critic together (trainer.keep_checkpoints)")
    handled = _port_lora({k: v for k, v in flat.items() if not _ignored(k, ignore)}, out, errors, notes)
    for key, value in flat.items():
        if _ignored(key, ignore) or key in handled:
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
    _port_context(flat, out, notes)
    _port_collapse(flat, out, notes)
    if "trainer.gradient_analysis_every" in flat and not flat.get("trainer.gradient_analysis_mode", False):
        out.setdefault("trainer", {})["gradient_analysis_every"] = 0  # RAGEN's gradient_analysis_mode false: off
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


def _port_context(flat: dict[str, Any], out: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """A config that names agent_proxy.context_window_mode is RAGEN-2's, whose modes read fewer keys than before:
    full ignores max_context_window (the whole history, one sequence per episode); limited_multi_turn and
    single_turn ignore use_turn_scores (every per-turn sequence carries the episode's score) and
    enable_response_mask (only the turn's own answer is trained). fastpo's matching settings are set so, with a
    note, where the config gives the ignored keys other values."""
    mode = flat.get("agent_proxy.context_window_mode")
    if mode is None:  # before RAGEN-2: max_context_window cuts the one sequence (fastpo's full mode, as ported)
        return
    r = out.setdefault("rollout", {})
    if mode == "full":
        if r.get("max_context_window", -1) != -1:
            notes.append(f"agent_proxy.max_context_window={flat['agent_proxy.max_context_window']!r}: no effect with "
                         f"context_window_mode full in RAGEN-2 (the whole history); rollout.max_context_window -1")
            r["max_context_window"] = -1
        return
    if r.get("reward_level", "trajectory") != "trajectory":
        notes.append(f"agent_proxy.use_turn_scores=True: no effect with context_window_mode {mode} (each turn's "
                     f"sequence carries the episode's score); rollout.reward_level trajectory")
        r["reward_level"] = "trajectory"
    if r.get("train_on_observations", False):
        notes.append(f"enable_response_mask=False: no effect with context_window_mode {mode} (only the turn's own "
                     f"answer is trained); rollout.train_on_observations false")
        r["train_on_observations"] = False


def _port_collapse(flat: dict[str, Any], out: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """RAGEN-2 computes its collapse metrics when first_turn_enabled or multi_turn_enabled (every compute_freq
    steps), and only with thoughts and the full context; fastpo's switch is trainer.collapse_every > 0, and its
    config refuses them without thoughts or with a limited window, so they are set off where RAGEN computes none."""
    t = out.get("trainer", {})
    if "collapse_every" not in t:
        return
    why = None
    if not (t.get("collapse_first_turn", True) or t.get("collapse_multi_turn", True)):
        why = "first_turn_enabled and multi_turn_enabled are both false"
    elif not out.get("rollout", {}).get("enable_think", True):
        why = "agent_proxy.enable_think is false (no thoughts to score)"
    elif out.get("rollout", {}).get("max_context_window", -1) != -1 or \
            flat.get("agent_proxy.context_window_mode", "full") != "full":
        why = "the context is not the full history"
    if why is not None:
        t["collapse_every"] = 0
        notes.append(f"collapse_detection: off (trainer.collapse_every 0): {why}, so RAGEN computes none either")


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
    from .cli import parse
    from .cli_schema import describe
    from .config import Config, ConfigError
    from .config_load import merge
    from .preflight import validate

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
