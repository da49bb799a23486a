"""Per-env training / validation mixes (``env.train`` / ``env.val``, RAGEN's ``es_manager`` env lists).

    entries = resolve_mix(cfg.env, "train")      # list[EnvEntry]; ValueError naming every bad entry
    entries[0].groups                            # the GLOBAL group ids this env runs, e.g. range(0, 6)
    errors = check_mix(cfg.env, world_size)      # config-time checks (every message names env.train[i] / env.val[i])

An entry is a mapping with the keys of ``ENTRY_KEYS``: ``name`` (required, a ``fastpo.envs.available()`` name),
``label`` (metric label, RAGEN's tag; default ``fastpo.rollout.env_label(name)``), ``groups`` (groups per
iteration; all entries give it or none does: then the split's total, ``env.env_groups`` / ``env.val_groups``, is
divided equally), ``group_size`` (default ``env.group_size`` / ``env.val_group_size``), ``kwargs`` (the env's
config for ``fastpo.envs.make``; default ``{}``, NOT ``env.kwargs``), ``max_turns`` and ``max_actions_per_turn``
(default the global ``env.max_turns`` / ``env.max_actions_per_turn``, as RAGEN's ``agent_proxy``),
``max_actions_per_traj`` (default the env's OWN budget, RAGEN's per-tag one: 10 for the grids, 1 for Bandit /
Countdown / MetaMathQA, a plug-in's ``max_actions_per_traj``), ``prompt`` (a RAGEN tag's own ``env_instruction``
and ``max_tokens`` in place of the env's; default ``{}``). Entries own contiguous blocks of global groups in
list order (RAGEN's layout); global group g always runs env seed ``seed_base + g``.

An empty list is the legacy single-config mode (``env.names`` round-robin, one ``env.kwargs``, the global
budgets), which ``resolve_mix`` also expresses as entries so the trainer has one code path. With ``env.train``
set and ``env.val`` empty, validation runs the training entries, ``env.val_groups`` split equally among them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastpo import envs
from fastpo.config import shown

#: Keys an ``env.train`` / ``env.val`` entry may have.
ENTRY_KEYS = ("name", "label", "groups", "group_size", "kwargs", "max_turns", "max_actions_per_turn",
              "max_actions_per_traj", "prompt")
#: Keys of an entry's ``prompt`` mapping: the ``prompts.EnvPromptSpec`` fields a RAGEN tag may set itself.
PROMPT_KEYS = ("env_instruction", "max_tokens")
_INT_KEYS = ("groups", "group_size", "max_turns", "max_actions_per_turn", "max_actions_per_traj")


@dataclass
class EnvEntry:
    """One env of a resolved mix.

    Attributes:
        name: registry name given to ``fastpo.envs.make``.
        label: metric label (``env/<label>/...``, ``val-env/<label>/...``).
        groups: the global group ids this env runs (each group shares one env seed).
        group_size: rollouts per group.
        kwargs: the env's config, with its step limit raised to the action budget where the env allows it.
        max_turns: turns per episode at most.
        max_actions_per_turn: actions parsed per answer at most.
        max_actions_per_traj: the episode's action budget; None keeps the env's own prompt budget.
        prompt: overrides of the env's prompt text (PROMPT_KEYS: a RAGEN tag's own ``env_instruction`` and
            ``max_tokens``, the "Max response length" number); empty keeps the env's own.
    """

    name: str
    label: str
    groups: list[int]
    group_size: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 5
    max_actions_per_turn: int | None = None
    max_actions_per_traj: int | None = None
    prompt: dict[str, Any] = field(default_factory=dict)


def _prompt_errors(at: str, prompt: Any) -> list[str]:
    """One line per bad ``prompt`` mapping key or value of an entry."""
    if not isinstance(prompt, dict):
        return [f"{at}.prompt must be a mapping with keys from {list(PROMPT_KEYS)}, got {shown(prompt)}"]
    errors = [f"{at}.prompt: unknown key {shown(k)}; accepted: {list(PROMPT_KEYS)}" for k in prompt
              if k not in PROMPT_KEYS]
    if "env_instruction" in prompt and not isinstance(prompt["env_instruction"], str):
        errors.append(f"{at}.prompt.env_instruction must be a str, got {shown(prompt['env_instruction'])}")
    tokens = prompt.get("max_tokens", 1)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        errors.append(f"{at}.prompt.max_tokens must be an int >= 1, got {shown(tokens)}")
    return errors


def own_budget(name: str, kwargs: dict[str, Any] | None = None, time_limit_s: float | None = None) -> int:
    """The env's own per-episode action budget (the number its prompt shows by default); a plug-in's is read from
    one instance built with ``kwargs``, in at most ``time_limit_s`` (``time_limit.call_with_time_limit``)."""
    from .prompts import env_prompt_spec
    from .time_limit import call_with_time_limit

    if envs.is_builtin(name):
        return env_prompt_spec(name).max_actions_per_traj
    probe = call_with_time_limit(partial(envs.make, name, 1, **(kwargs or {})), time_limit_s, f"env {name!r}: create")
    try:
        return env_prompt_spec(name, probe).max_actions_per_traj
    finally:
        probe.close()


def _split(env_cfg: Any, split: str) -> tuple[list[Any], int, int, str]:
    """(entries as configured, total groups, default group size, field name) of a split."""
    if split == "train":
        return list(env_cfg.train), env_cfg.env_groups, env_cfg.group_size, "env.train"
    if split != "val":
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if env_cfg.val or not env_cfg.train:
        return list(env_cfg.val), env_cfg.val_groups, env_cfg.val_group_size, "env.val"
    mirrored = [{k: v for k, v in dict(entry).items() if k not in ("groups", "group_size")} for entry in env_cfg.train
                if isinstance(entry, dict)]
    return mirrored, env_cfg.val_groups, env_cfg.val_group_size, "env.train (validation)"


#: Episodes of one split (groups x group size) at most: every group id is listed (and every episode built) at once,
#: so env.val_groups 99999999999 used to be killed for memory. RAGEN's largest settings use a few thousand.
MAX_EPISODES = 1 << 22


def _count_errors(env_cfg: Any, split: str, total: Any, default_size: Any) -> list[str]:
    """The split's group count and default group size against [1, MAX_EPISODES] (and their product), before any
    list of group ids is built; one line each."""
    groups_field = "env.env_groups" if split == "train" else "env.val_groups"
    size_field = "env.group_size" if split == "train" else "env.val_group_size"
    errors = [f"{name} must lie in [1, {MAX_EPISODES}], got {shown(value)}"
              for name, value in ((groups_field, total), (size_field, default_size))
              if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_EPISODES]
    uses_default = not (env_cfg.train if split == "train" else (env_cfg.val or env_cfg.train))
    if not errors and uses_default and total * default_size > MAX_EPISODES:
        errors.append(f"{groups_field} ({total}) x {size_field} ({default_size}) = {total * default_size} episodes "
                      f"per {'iteration' if split == 'train' else 'validation'}; at most {MAX_EPISODES}")
    return errors


def _raised_step_limit(name: str, budget: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The single-config mode's env config: `kwargs` with the env's step limit raised to the global action budget
    wherever ``envs.step_limit_config`` raises it (an env whose limit the config leaves at its default: the grids,
    2048, Sudoku, the cube), so that an episode does not stop silently below the budget its prompt shows. Where it
    would refuse the budget instead (a one-action env, QA's attempts, a plug-in's or the config's own lower limit)
    `kwargs` is kept: the one global budget (default 10) also reaches Bandit in this mode and has never been checked
    against each env; an env.train entry's own budget is."""
    try:
        return envs.step_limit_config(name, budget, kwargs)
    except ValueError:
        return dict(kwargs)


def _resolve(env_cfg: Any, split: str) -> tuple[list[EnvEntry], list[str]]:
    from .rollout import env_label

    raw, total, default_size, where = _split(env_cfg, split)
    errors = _count_errors(env_cfg, split, total, default_size)
    if errors:
        return [], errors
    if not raw:  # legacy: round-robin over the names, one kwargs dict, the global budgets
        names = (env_cfg.val_names or env_cfg.names) if split == "val" else env_cfg.names
        out = []
        for k, name in enumerate(names):
            budget = env_cfg.max_actions_per_traj
            kwargs = _raised_step_limit(name, budget, env_cfg.kwargs)
            out.append(EnvEntry(name, env_label(name), [g for g in range(total) if g % len(names) == k],
                                default_size, kwargs, env_cfg.max_turns, env_cfg.max_actions_per_turn, budget))
        return out, errors
    given = [isinstance(e, dict) and e.get("groups") is not None for e in raw]
    if any(given) and not all(given):
        errors.append(f"{where}: give 'groups' in every entry or in none (then {total} groups are split equally), "
                      f"got it in entries {[i for i, g in enumerate(given) if g]} only")
    elif not any(given) and total % len(raw):
        errors.append(f"{where}: {total} groups cannot be split equally among {len(raw)} entries; give each entry "
                      "its 'groups'")
    entries, start = [], 0
    for i, entry in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            errors.append(f"{at}: expected a mapping with keys {list(ENTRY_KEYS)}, got {shown(entry)}")
            continue
        unknown = [k for k in entry if k not in ENTRY_KEYS]
        for k in unknown:
            close = difflib.get_close_matches(str(k), ENTRY_KEYS, n=1, cutoff=0.5)
            errors.append(f"{at}: unknown key {shown(k)}; accepted: {list(ENTRY_KEYS)}"
                          + (f"; did you mean {close[0]}?" if close else ""))
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            errors.append(f"{at}.name: required, a fastpo.envs.available() name, got {name!r}")
            continue
        if name.lower() not in envs.available():
            close = difflib.get_close_matches(name.lower(), envs.available(), n=3, cutoff=0.5)
            errors.append(f"{at}.name: unknown env {name!r}; choose from {envs.available()}"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + ("" if envs.is_builtin(name) else " (plug-in envs need env.plugins)"))
            continue
        bad = False
        for key in _INT_KEYS:
            value = entry.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                errors.append(f"{at}.{key} must be an int >= 1, got {shown(value)}")
                bad = True
        label = entry.get("label", env_label(name))
        if not isinstance(label, str) or not label.strip() or "/" in label:
            errors.append(f"{at}.label must be a non-empty str without '/', got {shown(label)}")
            bad = True
        kwargs = entry.get("kwargs", {})
        if not isinstance(kwargs, dict):
            errors.append(f"{at}.kwargs must be a mapping (the env's config), got {shown(kwargs)}")
            bad = True
        prompt_errors = _prompt_errors(at, entry.get("prompt", {}))
        if prompt_errors:
            errors += prompt_errors
            continue
        if bad:
            continue
        groups = entry["groups"] if all(given) else total // len(raw)
        size = entry.get("group_size") or default_size
        if groups > MAX_EPISODES:
            errors.append(f"{at}.groups must lie in [1, {MAX_EPISODES}], got {groups}")
            continue
        if groups * size > MAX_EPISODES:
            errors.append(f"{at}: {groups} groups x group_size {size} = {groups * size} episodes; a split runs at "
                          f"most {MAX_EPISODES}")
            continue
        try:
            budget = entry.get("max_actions_per_traj") or own_budget(name, kwargs, _time_limit(env_cfg))
            kwargs = envs.step_limit_config(name, budget, kwargs)
        except Exception as e:  # a plug-in's own failure (probe construction) is reported with the entry
            errors.append(f"{at}: {e}")
            continue
        entries.append(EnvEntry(
            name, label, list(range(start, start + groups)), entry.get("group_size") or default_size, kwargs,
            entry.get("max_turns") or env_cfg.max_turns, entry.get("max_actions_per_turn") or
            env_cfg.max_actions_per_turn, budget, dict(entry.get("prompt", {}))))
        start += groups
    episodes = sum(len(e.groups) * e.group_size for e in entries)
    if episodes > MAX_EPISODES:
        errors.append(f"{where}: the entries run {episodes} episodes (groups x group_size); a split runs at most "
                      f"{MAX_EPISODES}")
    if all(given) and raw and not errors and start != total:
        total_field = "env.env_groups" if split == "train" else "env.val_groups"
        errors.append(f"{where}: the entries' groups add up to {start}, but {total_field} is {total}; make them "
                      "equal")
    labels = [e.label for e in entries]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        errors.append(f"{where}: label {label!r} is used by more than one entry; metrics are per label, so give "
                      "each entry its own 'label'")
    return entries, errors


def resolve_mix(env_cfg: Any, split: str) -> list[EnvEntry]:
    """The entries of the ``train`` or ``val`` split of an ``EnvConfig`` (see the module docstring). Raises
    ValueError listing every problem (one line when there is one)."""
    entries, errors = _resolve(env_cfg, split)
    if errors:
        raise ValueError(errors[0] if len(errors) == 1 else "invalid env mix:\n  " + "\n  ".join(errors))
    return entries


def check_mix(env_cfg: Any, world_size: int = 1, backend: str = "default") -> list[str]:
    """Config-time checks of both splits (before any model loads): the entries themselves, each env built once
    with its kwargs (bad kwargs for that env are reported with the entry), and per-entry group sizes. Returns the
    error lines (empty when fine)."""
    from .time_limit import PreflightTimeout, call_with_time_limit

    errors, built = [], set()
    if env_cfg.train and env_cfg.val_names:
        errors.append("env.val_names cannot be combined with env.train; list the validation envs in env.val")
    for split in ("train", "val"):
        entries, errs = _resolve(env_cfg, split)
        if split == "val" and not env_cfg.val:  # the mirrored train entries: their own errors are listed already
            errs = [x for x in errs if not x.startswith("env.train (validation)[")]
        errors += errs
        if errs or not (env_cfg.train if split == "train" else (env_cfg.val or env_cfg.train)):
            continue
        for i, entry in enumerate(entries):
            key = (entry.name.lower(), repr(sorted(entry.kwargs.items())))
            if key in built:  # the same env and kwargs (e.g. a validation entry mirrored from env.train): built once
                continue
            built.add(key)
            try:
                call_with_time_limit(partial(envs.make, entry.name, 1, backend=backend, **entry.kwargs),
                                     _time_limit(env_cfg), f"env {entry.name!r}: create").close()
            except PreflightTimeout as e:
                errors.append(f"env.{split}[{i}]: {e}")
            except Exception as e:
                errors.append(f"env.{split}[{i}].kwargs: env {entry.name!r} rejects {shown(entry.kwargs)}: {e}")
    return errors


def _time_limit(env_cfg: Any) -> float | None:
    """``env.preflight_timeout_s`` of an env section (the default for sections without it)."""
    from .config import PREFLIGHT_TIMEOUT_S

    return getattr(env_cfg, "preflight_timeout_s", PREFLIGHT_TIMEOUT_S)


def trajectory_offsets(entries: list[EnvEntry]) -> dict[int, int]:
    """Global index of each group's first trajectory: groups in id order, each ``group_size`` long (so 1 and N
    ranks number the trajectories, hence their sampling seeds, alike)."""
    sizes = sorted((g, e.group_size) for e in entries for g in e.groups)
    offsets, at = {}, 0
    for g, size in sizes:
        offsets[g] = at
        at += size
    return offsets


@dataclass
class EnvPart:
    """One env of a mix as one rank builds it: its batch env for the rank's groups of that entry and their prompt.

    Attributes:
        entry: the mix entry (name, label, budgets, kwargs).
        groups: the GLOBAL group ids this rank runs for the entry.
        env: the batch env, ``len(groups) * entry.group_size`` instances (times ``capacity``, plus ``extra``).
        spec: the prompt (``prompts.env_prompt_spec``: RAGEN's for built-in envs, the env's own for a plug-in).
        first_index: the global index of each group's first trajectory (its sampling seeds' index).
    """

    entry: EnvEntry
    groups: list[int]
    env: Any
    spec: Any
    first_index: list[int]


def build_parts(entries: list[EnvEntry], groups: range, backend: str, enable_think: bool,
                action_sep: str, capacity: int = 1, extra: int = 0) -> list[EnvPart]:
    """The parts of ``entries`` that this rank's ``groups`` belong to (one batch env each, with the entry's own
    kwargs and action budget in its prompt). ``capacity``: instances per trajectory of one iteration (partial
    rollouts hold episodes of several iterations at once); ``extra``: instances added to each part on top
    (``rollout.partial_spare``'s episodes)."""
    from .prompts import env_prompt_spec

    offsets = trajectory_offsets(entries)
    parts = []
    for entry in entries:
        mine = [g for g in groups if g in set(entry.groups)]
        if not mine:
            continue
        env = envs.make(entry.name, len(mine) * entry.group_size * capacity + extra, backend=backend,
                        **entry.kwargs)
        budget = {} if entry.max_actions_per_traj is None else {"max_actions_per_traj": entry.max_actions_per_traj}
        spec = env_prompt_spec(entry.name, env, enable_think=enable_think, action_sep=action_sep, **budget,
                               **entry.prompt)
        parts.append(EnvPart(entry, mine, env, spec, [offsets[g] for g in mine]))
    return parts
