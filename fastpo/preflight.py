"""Checks of a config before any model loads, so that bad input ends in one ``ConfigError`` line and exit status 2,
never a traceback mid-run: :func:`validate` composes the sections' own checks (``fastpo.config``) with those that
need another module (the env and algorithm registries, ``fastpo.cli``'s type conversion) and the world outside the
config (files, env constructors, the tokenizer).

    validate(cfg, world_size=8)            # raises ConfigError naming every bad field; returns cfg
    errors = check_inputs(cfg)             # list of one-line problems with paths, env kwargs, the resume hash
    check_prompt_fits(cfg, tokenizer)      # ConfigError when no episode could take a single turn
    first_prompt_len(tokenizer, "sokoban", seed=123, max_model_len=...)   # token count of turn 1's prompt

Building an env of one instance is cheap (no model, no tokenizer); each construction and reset is bounded by
``env.preflight_timeout_s`` (``fastpo.time_limit``). The prompt check needs the tokenizer, so the trainer runs it
right after loading the tokenizer and before the models.
"""

from __future__ import annotations

import contextlib
import os
import typing
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fastpo import envs

from . import config_values as cli  # the converter the command line and --config files share
from .config import SECTIONS, Config, ConfigError, config_hash, field_types, shown
from .env_mix import check_mix, resolve_mix
from .time_limit import PreflightTimeout, call_with_time_limit

#: Failures an env raises for bad keyword arguments or for levels it cannot generate.
_ENV_ERRORS = (ValueError, TypeError, RuntimeError, OSError, KeyError)
#: The tiny agent placeholder of ``model.path`` (resolved by the trainer, never a path).
_TINY = "tiny"


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Every check before any model loads, each section's next to its own: field types, non-finite floats, then
    per section its ``check()`` and the checks that need a registry, the rules between sections, and last (on a
    config sound in itself) :func:`check_inputs`. Raises one ConfigError listing every problem, each line naming
    its field(s); returns cfg."""
    errors = field_type_errors(cfg)
    errors += [] if errors else cfg.nonfinite_errors()
    _raise(errors)
    errors = [] if isinstance(world_size, int) and world_size >= 1 else [
        f"world_size must be an int >= 1, got {world_size!r}"]
    world_size = max(int(world_size), 1) if isinstance(world_size, int) else 1
    errors += cfg.model.check()
    errors += _env_name_errors(cfg.env)
    errors += cfg.env.check(world_size)
    errors += check_mix(cfg.env, world_size, cfg.env.backend)
    errors += cfg.rollout.check()
    errors += _algorithm_registry_errors(cfg)
    errors += cfg.algorithm.check()
    errors += cfg.optim.check(world_size)
    errors += cfg.trainer.check()
    errors += cfg.cross_checks(world_size)
    if not errors:  # the checks that touch files and build envs, only on a config that is sound in itself
        errors += check_inputs(cfg)
    _raise(errors)
    return cfg


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def field_type_errors(cfg: Config) -> list[str]:
    """One line per field whose value is not of its declared type or Literal choices (a config built in code
    rather than parsed), converted as the command line converts it (``fastpo.cli.coerce``)."""
    errors = []
    for section in SECTIONS:
        for key, tp in field_types(section).items():
            value = getattr(getattr(cfg, section), key)
            try:
                cli.coerce(value, tp, f"{section}.{key}")
                if isinstance(value, str) and not (tp is str or typing.get_origin(tp) is Literal):
                    raise ConfigError(f"{section}.{key}: expected {cli.type_name(tp)}, got {shown(value)}")
            except ConfigError as err:
                errors.append(str(err))
    return errors


def _env_name_errors(e: Any) -> list[str]:
    """env.plugins import (they add env names), then env.names / env.val_names against the env registry."""
    errors = []
    try:
        envs.load_plugins(e.plugins)
    except ValueError as err:
        errors.append(f"env.plugins: {err}")
    known = envs.available()
    for field_name, names in (("env.names", e.names), ("env.val_names", e.val_names)):
        errors += [f"{field_name}: unknown env {shown(n)}; choose from {known}{cli.did_you_mean(n.lower(), known)}"
                   for n in names if n.lower() not in known]
    return errors


def _algorithm_registry_errors(cfg: Config) -> list[str]:
    """The estimator, filter and loss names against their registries (``fastpo.algorithms``), RAGEN-2's filter
    arguments (``fastpo.rollout_filter``), and what the estimator and the legacy filter imply for the other sections:
    the critic's settings, the kept groups against optim.mini_batch_size."""
    from . import algorithms, rollout_filter

    a, e, o, m = cfg.algorithm, cfg.env, cfg.optim, cfg.model
    errors = []
    estimators, filters, losses = algorithms.ADV_ESTIMATORS, algorithms.ROLLOUT_FILTERS, algorithms.POLICY_LOSSES
    if a.adv_estimator not in estimators:
        errors.append(f"algorithm.adv_estimator: unknown {a.adv_estimator!r}; choose from {sorted(estimators)}"
                      f"{cli.did_you_mean(a.adv_estimator, estimators)}")
    if a.rollout_filter_type not in filters:
        errors.append(f"algorithm.rollout_filter_type: unknown {a.rollout_filter_type!r}; choose from "
                      f"{sorted(filters)}{cli.did_you_mean(a.rollout_filter_type, filters)}")
    if a.policy_loss not in losses:
        errors.append(f"algorithm.policy_loss: unknown {a.policy_loss!r}; choose from {sorted(losses)}")
    if a.rollout_filter_strategy != "legacy":
        try:
            rollout_filter.check_filter_args(
                a.rollout_filter_strategy, a.rollout_filter_value, a.rollout_filter_metric,
                a.rollout_filter_direction, a.rollout_filter_top_p_prob_mode, a.rollout_filter_selection_eps,
                a.rollout_filter_include_zero)
        except ValueError as err:
            errors.append(f"algorithm.{err}" if str(err).startswith("rollout_filter") else str(err))
    kept = (algorithms.kept_group_count(e.env_groups, a.rollout_filter_ratio, a.rollout_filter_type)
            if a.rollout_filter_strategy == "legacy" else None)  # RAGEN-2's filters keep a data-dependent count
    if kept is not None and 0 < a.rollout_filter_ratio <= 1 and e.env_groups >= 1:
        group_size = e.smallest_group_size()
        turns = e.max_turns if cfg.rollout.context_window_mode != "full" else 1
        if kept < 1:
            errors.append(f"algorithm.rollout_filter_ratio ({a.rollout_filter_ratio}) keeps int(ratio * "
                          f"env.env_groups) = {kept} of {e.env_groups} groups; at least 1 is needed")
        elif kept * group_size * turns < o.mini_batch_size:  # per-turn modes: up to max_turns sequences each (RAGEN-2)
            per = f" x env.max_turns {turns} sequences" if turns > 1 else ""
            errors.append(f"algorithm.rollout_filter_ratio ({a.rollout_filter_ratio}) keeps {kept} groups x "
                          f"env.group_size {group_size}{per} = {kept * group_size * turns} trajectories, fewer than "
                          f"optim.mini_batch_size ({o.mini_batch_size})")
    if a.adv_estimator in estimators:
        if algorithms.needs_critic(a):
            if o.critic_lr <= 0:
                errors.append(f"optim.critic_lr must be > 0: algorithm.adv_estimator={a.adv_estimator!r} trains a "
                              f"critic, got {o.critic_lr}")
        elif m.critic_path:
            errors.append(f"model.critic_path is set ({m.critic_path!r}) but algorithm.adv_estimator="
                          f"{a.adv_estimator!r} uses no critic")
    return errors


def check_inputs(cfg: Config) -> list[str]:
    """One line per problem with the model / run / resume paths, the env keyword arguments and the resume
    checkpoint's config hash; [] when all is well. Builds each env with one instance and resets it at the first
    training / validation seed (no model is loaded)."""
    errors = _model_paths(cfg) + _run_paths(cfg) + _env_kwargs(cfg)
    if not errors:
        errors += _resume_hash(cfg)
    return errors


def _model_paths(cfg: Config) -> list[str]:
    from .model_path import _looks_like_path, resolve_model_path

    errors = []
    for field, path in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path)):
        # hub ids are left to the loader (it checks the offline cache); local paths are checked here
        if not path or path == _TINY or not _looks_like_path(os.path.expanduser(path)):
            continue
        try:
            resolve_model_path(path, "model")
            if field == "model.path" and os.path.isdir(os.path.expanduser(path)):
                resolve_model_path(path, "tokenizer")
        except ValueError as err:
            errors.append(f"{field}: {err}")
    return errors


def _first_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _run_paths(cfg: Config) -> list[str]:
    t, errors = cfg.trainer, []
    run_dir = Path(os.path.expanduser(t.run_dir))
    base = _first_existing(run_dir.absolute())
    if not base.is_dir():
        what = "is a file" if base == run_dir.absolute() else f"lies under the file {str(base)!r}"
        errors.append(f"trainer.run_dir {t.run_dir!r} {what}; pass a directory (it is created if missing)")
    elif not os.access(base, os.W_OK | os.X_OK):
        errors.append(f"trainer.run_dir {t.run_dir!r}: {str(base)!r} is not writable; pass a writable directory")
    else:
        errors += _unwritable_run_files(run_dir, t.run_dir)
    if t.resume not in ("auto", "never"):
        path = Path(os.path.expanduser(t.resume))
        if not path.is_dir():
            errors.append(f"trainer.resume {shown(t.resume)}: no such checkpoint directory; accepted: 'auto', 'never' "
                          f"or the path of a checkpoint directory (e.g. <run_dir>/checkpoints/step-000010)")
        else:
            problem = _not_a_checkpoint(path)
            if problem:
                errors.append(f"trainer.resume {shown(t.resume)}: {problem}")
    return errors


def _unwritable_run_files(run_dir: Path, given: str) -> list[str]:
    """What the run writes into that already exists but cannot be written: a read-only ``checkpoints/`` passed the
    run directory's own check and failed at the first save, after a full iteration."""
    from .storage import RUN_FILES

    errors = []
    for name in (*RUN_FILES, "config.json"):
        path = run_dir / name
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            errors.append(f"trainer.run_dir {shown(given)}: {str(path)!r} is not writable (the run writes there); "
                          f"make it writable or choose another trainer.run_dir")
    return errors


def _not_a_checkpoint(path: Path) -> str | None:
    """Why the folder given as trainer.resume is not a checkpoint (None when it has the COMPLETE marker; its files
    are verified when it loads), with the checkpoint to pass instead when it is a run or checkpoints folder."""
    from .checkpoint import MARKER, latest

    if (path / MARKER).is_file():
        return None
    run = path.parent if path.name == "checkpoints" else path
    newest = latest(run)
    if newest is not None:
        return (f"{str(path)!r} is a run folder, not a checkpoint; pass its newest checkpoint {str(newest)!r}, or "
                f"--trainer.run_dir {run} --trainer.resume auto")
    what = (f"has no {MARKER} marker (an interrupted or unpublished save)" if path.name.startswith("step-") else
            f"is not a checkpoint folder (no {MARKER} marker)")
    return (f"{str(path)!r} {what}; a checkpoint folder is <run_dir>/checkpoints/step-NNNNNN holding {MARKER}, "
            f"trainer_state.json and the .distcp / .metadata files")


def _mix_entries(cfg: Config) -> list[tuple[str, Any, int]]:
    """(where, entry, first env seed) of every training and validation env as the trainer will build it
    (``fastpo.env_mix``: legacy ``env.names`` or ``env.train`` / ``env.val`` entries, each with its own kwargs and
    budgets). ``where`` names the field a problem should be reported under. A split whose entries do not resolve
    is left out (:func:`validate` reports those already)."""
    e, out = cfg.env, []
    for split, base in (("train", e.train_seed), ("val", e.val_seed)):
        try:
            entries = resolve_mix(e, split)
        except ValueError:
            continue
        mixed = e.train if split == "train" else (e.val or e.train)
        for i, entry in enumerate(entries):
            where = f"env.{'val' if split == 'val' and e.val else 'train'}[{i}].kwargs" if mixed else "env.kwargs"
            out.append((where, entry, base + min(entry.groups, default=0)))
    return out


def _env_kwargs(cfg: Config) -> list[str]:
    """Each env of both splits built with one instance from its own kwargs and reset at its first seeds (a level
    that cannot be generated, e.g. Sokoban ``dim_room [4, 4]``, fails here and not mid-run); one line per env
    configuration."""
    configs: dict[tuple, tuple[str, Any, list[int]]] = {}
    for where, entry, seed in _mix_entries(cfg):
        key = (where, entry.name.lower(), repr(sorted(entry.kwargs.items())))
        configs.setdefault(key, (where, entry, []))[2].append(seed)
    errors, limit = [], cfg.env.preflight_timeout_s
    for where, entry, seeds in configs.values():
        env = None
        try:
            env = call_with_time_limit(partial(envs.make, entry.name, 1, backend=cfg.env.backend, **entry.kwargs),
                                       limit, f"env {entry.name!r}: create")
            for seed in dict.fromkeys(seeds):
                call_with_time_limit(partial(env.reset, np.array([seed], dtype=np.int64)), limit,
                                     f"env {entry.name!r}: reset (seed {seed})")
            env.close()
        except PreflightTimeout as err:  # the env is still inside the call that hangs: left alone
            errors.append(str(err))
        except _ENV_ERRORS as err:
            text = " ".join(str(err).split()) or type(err).__name__
            given = cfg.env.kwargs if where == "env.kwargs" else entry.kwargs
            errors.append(f"{where} {shown(given)}: env {entry.name!r} (env.backend {cfg.env.backend}) refuses them: "
                          f"{text}")
            _close_after_failure(env)
    return errors


def _close_after_failure(env: Any) -> None:
    """Close an env whose check failed; its own close() failing too is not reported (the first failure is)."""
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()


def _resume_hash(cfg: Config) -> list[str]:
    """The checkpoint a resume would load was saved under another config: refuse now rather than after the models
    load. Unreadable checkpoints are left to the loader, which reports (or skips) them."""
    from . import checkpoint

    t = cfg.trainer
    if t.resume == "never":
        return []
    try:
        path = checkpoint.latest(t.run_dir) if t.resume == "auto" else Path(os.path.expanduser(t.resume))
        if path is None:
            return []
        saved = checkpoint.read_meta(path).get("config_hash")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    mine = config_hash(cfg)
    if saved is None or saved == mine:
        return []
    return [f"trainer.resume {t.resume!r}: checkpoint {str(path)!r} was saved with config hash {saved}, this config's "
            f"hash is {mine} (a field that changes the training math differs from that run's config.json); pass "
            f"that run's config (--config <run_dir>/config.json), another --trainer.run_dir, or --trainer.resume "
            f"never --trainer.overwrite true (replaces that run)"]


def lora_rank_error(cfg: Config, model_path: str) -> str | None:
    """``model.lora_rank`` above the smallest adapted layer of the policy at `model_path` (resolved) or of the critic
    (``model.critic_path``, when a critic trains), found on a meta-device skeleton (no weights read) before any model
    loads; None when it fits or LoRA is off."""
    from . import algorithms
    from .model import load_policy, lora_rank_limit, resolve_model_path

    m = cfg.model
    if m.lora_rank <= 0:
        return None
    paths = [("model.path", model_path)]
    if m.critic_path and algorithms.needs_critic(cfg.algorithm):
        paths.append(("model.critic_path", resolve_model_path(m.critic_path)))
    for field, path in paths:
        try:
            limit = lora_rank_limit(load_policy(path, meta=True), m.lora_target_modules)
        except (ValueError, OSError):  # an unreadable model is the loader's to report, where it loads
            continue
        if limit is not None and m.lora_rank > limit[0]:
            return (f"model.lora_rank {m.lora_rank} exceeds the smallest layer that model.lora_target_modules="
                    f"{shown(m.lora_target_modules)} adapts in {field} ({limit[1]}); accepted: 1 to {limit[0]}")
    return None


def first_prompt_len(tokenizer: Any, env_name: str, seed: int, *, enable_think: bool = True, action_sep: str = "||",
                     max_actions_per_traj: int | None = None, max_context_window: int = -1, backend: str = "default",
                     env_kwargs: dict[str, Any] | None = None, time_limit_s: float | None = None,
                     context_window_mode: str = "full") -> int:
    """Token count of the first turn's prompt of env `env_name` at env seed `seed`, rendered as the rollout
    renders it (``prompts.build_messages``, or ``turn_messages`` under a per-turn ``context_window_mode``, +
    ``render_chat``, no special tokens added). A plug-in env's prompt
    comes from the env itself (``prompts.env_prompt_spec``). ``time_limit_s`` bounds the env's construction and
    reset (``fastpo.time_limit.call_with_time_limit``)."""
    from .prompts import Turn, build_messages, env_prompt_spec, render_chat, turn_messages

    overrides: dict[str, Any] = {"enable_think": enable_think, "action_sep": action_sep}
    if max_actions_per_traj is not None:
        overrides["max_actions_per_traj"] = max_actions_per_traj
    env = call_with_time_limit(partial(envs.make, env_name, 1, backend=backend, **(env_kwargs or {})), time_limit_s,
                               f"env {env_name!r}: create")
    try:
        spec = env_prompt_spec(env_name, env, **overrides)
        obs = call_with_time_limit(partial(env.reset, np.array([seed], dtype=np.int64)), time_limit_s,
                                   f"env {env_name!r}: reset (seed {seed})")[0]
    except PreflightTimeout:  # the env is still inside the call that hangs: left alone
        raise
    except BaseException:
        _close_after_failure(env)
        raise
    env.close()
    turns = [Turn(obs, actions_left=spec.max_actions_per_traj)]
    window = max_context_window if max_context_window > 0 else -1
    messages = (build_messages(spec, turns, window) if context_window_mode == "full"
                else turn_messages(spec, turns, context_window_mode, window))
    text = render_chat(tokenizer, messages, enable_think)
    return len(tokenizer.encode(text, add_special_tokens=False))


def prompt_fit_error(prompt_len: int, env_name: str, seed: int, response_length: int, max_model_len: int,
                     len_name: str = "rollout.max_model_len", response_name: str = "rollout.response_length") -> str:
    """The one-line message for a first prompt that leaves no room for a turn ('' when it fits)."""
    if prompt_len + response_length <= max_model_len:
        return ""
    return (f"{len_name} ({max_model_len}) is too short: the first prompt of env {env_name!r} (seed {seed}) is "
            f"{prompt_len} tokens and a turn needs {response_name} ({response_length}) more, so no episode could take "
            f"a turn; set {len_name} >= {prompt_len + response_length} or lower {response_name}")


def check_prompt_fits(cfg: Config, tokenizer: Any) -> None:
    """ConfigError when a training or validation env's first prompt plus ``rollout.response_length`` exceeds
    ``rollout.max_model_len`` (every episode would end with 0 turns and nothing would be trained). Each env is
    rendered with its own kwargs and action budget, as the trainer builds it."""
    r = cfg.rollout
    errors, failed = [], set()
    for _, entry, seed in _mix_entries(cfg):
        n = first_prompt_len(tokenizer, entry.name, seed, enable_think=r.enable_think, action_sep=cfg.env.action_sep,
                             max_actions_per_traj=entry.max_actions_per_traj,
                             max_context_window=r.max_context_window, backend=cfg.env.backend,
                             env_kwargs=entry.kwargs, time_limit_s=cfg.env.preflight_timeout_s,
                             context_window_mode=r.context_window_mode)
        msg = prompt_fit_error(n, entry.name, seed, r.response_length, r.max_model_len)
        if msg and entry.label not in failed:  # one line per env
            failed.add(entry.label)
            errors.append(msg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
