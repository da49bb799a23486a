"""Checks of a config against the world outside it (files, env constructors, the tokenizer), run before any model
loads so that bad input ends in one ``ConfigError`` line and exit status 2, never a traceback mid-run.

    errors = check_inputs(cfg)             # list of one-line problems (config.validate calls it)
    check_prompt_fits(cfg, tokenizer)      # ConfigError when no episode could take a single turn
    first_prompt_len(tokenizer, "sokoban", seed=123, max_model_len=...)   # token count of turn 1's prompt
    call_with_time_limit(fn, 60.0, "env 'guess': reset (seed 5)")       # fn(), or PreflightTimeout after 60 s

``config.validate`` covers what the config alone decides (ranges, types, cross-field rules); this module covers
what needs the file system or building an env of one instance (cheap: no model, no tokenizer). The prompt check
needs the tokenizer, so the trainer runs it right after loading the tokenizer and before the models.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from .config import Config, ConfigError, config_hash
from .config_io import shown

#: Failures an env raises for bad keyword arguments or for levels it cannot generate.
_ENV_ERRORS = (ValueError, TypeError, RuntimeError, OSError, KeyError)
#: The tiny agent placeholder of ``model.path`` (resolved by the trainer, never a path).
_TINY = "tiny"


class PreflightTimeout(ConfigError):
    """A call into an env during the checks did not return within ``env.preflight_timeout_s``."""


def call_with_time_limit(fn: Callable[[], Any], limit_s: float | None, what: str) -> Any:
    """``fn()``, given at most ``limit_s`` seconds (None or inf: no limit); ``what`` names the call in the error, e.g.
    ``"env 'guess': reset (seed 5)"``. Exceptions of ``fn`` (SystemExit included) are raised here.

    Python cannot stop a function from outside, so ``fn`` runs in a daemon thread that the caller stops waiting for:
    :class:`PreflightTimeout` says which call hung and the command then exits (status 2). Limitations: the stuck call
    goes on in the background until the process ends (do not reuse the object it works on); a call that never
    releases the GIL (a C extension's busy loop) cannot be waited out; and ``fn`` runs outside the main thread, so
    an env that installs signal handlers there fails."""
    if limit_s is None or not math.isfinite(limit_s):
        return fn()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # handed over to the caller's thread, which raises it
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"fastpo-preflight {what}", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise PreflightTimeout(f"{what} did not return within env.preflight_timeout_s ({limit_s:g} s); fix the env, "
                               f"or raise env.preflight_timeout_s if it needs longer (inf = no limit)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def check_inputs(cfg: Config) -> list[str]:
    """One line per problem with the model / run / resume paths, the env keyword arguments and the resume
    checkpoint's config hash; [] when all is well. Builds each env with one instance and resets it at the first
    training / validation seed (no model is loaded)."""
    errors = _model_paths(cfg) + _run_paths(cfg) + _env_kwargs(cfg)
    if not errors:
        errors += _resume_hash(cfg)
    return errors


def _model_paths(cfg: Config) -> list[str]:
    from .model import _looks_like_path, resolve_pretrained

    errors = []
    for field, path in (("model.path", cfg.model.path), ("model.critic_path", cfg.model.critic_path)):
        # hub ids are left to the loader (it checks the offline cache); local paths are checked here
        if not path or path == _TINY or not _looks_like_path(os.path.expanduser(path)):
            continue
        try:
            resolve_pretrained(path, ("config.json",), "model")
            if field == "model.path" and os.path.isdir(os.path.expanduser(path)):
                resolve_pretrained(path, ("tokenizer_config.json", "tokenizer.json"), "tokenizer")
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
    is left out (``config.validate`` reports those already)."""
    from .env_mix import resolve_mix

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
    from fastpo import envs

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
                     env_kwargs: dict[str, Any] | None = None, time_limit_s: float | None = None) -> int:
    """Token count of the first turn's prompt of env `env_name` at env seed `seed`, rendered as the rollout
    renders it (``prompts.build_messages`` + ``render_chat``, no special tokens added). A plug-in env's prompt
    comes from the env itself (``prompts.env_prompt_spec``). ``time_limit_s`` bounds the env's construction and
    reset (:func:`call_with_time_limit`)."""
    from fastpo import envs

    from .prompts import Turn, build_messages, env_prompt_spec, render_chat

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
    text = render_chat(tokenizer, build_messages(spec, turns, window), enable_think)
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
                             env_kwargs=entry.kwargs, time_limit_s=cfg.env.preflight_timeout_s)
        msg = prompt_fit_error(n, entry.name, seed, r.response_length, r.max_model_len)
        if msg and entry.label not in failed:  # one line per env
            failed.add(entry.label)
            errors.append(msg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def train_seed_errors(cfg: Config, int64_max: int) -> list[str]:
    """The last training group's env seed, train_seed + (iterations + 1) * env_groups - 1, must fit in int64 (env
    seeds reach numpy and C++ as int64). The message leads with the larger of the two terms: a huge trainer.iterations
    was blamed on env.train_seed, with a negative bound. [] when it fits."""
    e, iterations = cfg.env, max(cfg.trainer.iterations, 0)
    groups, seed = max(e.env_groups, 1), max(e.train_seed, 0)
    span = (iterations + 1) * groups  # seeds the run draws from train_seed on
    if seed + span - 1 <= int64_max:
        return []
    why = f"the seed counter advances by env.env_groups ({e.env_groups}) per iteration and env seeds are int64"
    most_iterations = (int64_max - seed + 1) // groups - 1
    if span > seed and most_iterations >= 0:
        return [f"trainer.iterations ({cfg.trainer.iterations}) must be <= {most_iterations} with env.train_seed "
                f"({e.train_seed}): {why}"]
    if span <= seed:
        return [f"env.train_seed ({e.train_seed}) must be <= {int64_max - span + 1} with trainer.iterations "
                f"({cfg.trainer.iterations}): {why}"]
    return [f"env.train_seed ({e.train_seed}) must be <= {int64_max - groups + 1} (room for one iteration) and "
            f"trainer.iterations ({cfg.trainer.iterations}) far lower: {why}"]


def finite_float_errors(cfg: Config, inf_ok: frozenset[str]) -> list[str]:
    """NaN in any float field, or +-inf in one not listed in `inf_ok` (``section.field`` names that document
    "inf disables")."""
    import dataclasses

    errors = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(obj):  # a tool's own option beside the sections (bench/diagnose_groups.py)
            continue
        for f in dataclasses.fields(obj):
            value, name = getattr(obj, f.name), f"{section.name}.{f.name}"
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if not isinstance(v, float) or math.isfinite(v):
                    continue
                if math.isnan(v) or name not in inf_ok:
                    allowed = "a finite number or inf" if name in inf_ok else "a finite number"
                    errors.append(f"{name} must be {allowed}, got {shown(value)}")
                    break
    return errors
