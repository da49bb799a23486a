"""fastpo.envs: batched environments with RAGEN's rules.

    env = fastpo.envs.make("sokoban", num_envs=64, dim_room=(6, 6), num_boxes=1)
    obs = env.reset(np.arange(64))
    obs, reward, terminated, truncated, info = env.step(np.full(64, 1, dtype=np.int32))

Sokoban, FrozenLake, 2048, Sudoku and the 2x2 Rubik's cube run in the C++ batch simulator (``fastpo._C``);
``backend="python"`` selects their pure-Python twins (the test oracle and the speed baseline). Bandit, Countdown
and the QA env are Python; users' own text environments plug in through ``fastpo.envs.text`` (see ``TextEnv``) and
``register(name, factory)``, which makes them available to ``make`` (docs/ENVS.md).

Plug-ins: ``load_plugins(["my_envs"])`` imports modules that call ``register`` (the trainer, eval and SFT
command lines do it for ``--env.plugins`` / ``--plugins``), and installed packages declare an entry point in
the ``fastpo.envs`` group (``my_envs = "my_pkg.envs"`` imports that module; ``"my_pkg.envs:setup"`` imports it
and calls ``setup()``), loaded on the first use of the registry (``available``, ``make``, ``is_builtin``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from .base import INFO_KEYS, BatchEnv

# name -> {backend: "module:Class"}; modules are imported lazily so a missing optional piece
# (e.g. the C++ extension during a source checkout) only fails for the env that needs it.
_REGISTRY: dict[str, dict[str, str | Callable[..., BatchEnv]]] = {
    "sokoban": {"cpp": "fastpo.envs.sokoban:SokobanEnv", "python": "fastpo.envs.py_sokoban:PySokobanEnv"},
    "frozenlake": {
        "cpp": "fastpo.envs.frozenlake:FrozenLakeEnv",
        "python": "fastpo.envs.py_frozenlake:PyFrozenLakeEnv",
    },
    "game_2048": {"cpp": "fastpo.envs.game2048:Game2048Env", "python": "fastpo.envs.py_game2048:PyGame2048Env"},
    "sudoku": {"cpp": "fastpo.envs.sudoku:SudokuEnv", "python": "fastpo.envs.py_sudoku:PySudokuEnv"},
    "rubikscube": {"cpp": "fastpo.envs.rubiks:RubiksEnv", "python": "fastpo.envs.py_rubiks:PyRubiksEnv"},
    "bandit": {"python": "fastpo.envs.bandit:BanditEnv"},
    "countdown": {"python": "fastpo.envs.countdown:CountdownEnv"},
    "qa": {"python": "fastpo.envs.qa:QAEnv"},
}
_BUILTIN = frozenset(_REGISTRY)  # names register() must not replace

# Preset configurations under their RAGEN names.
_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "simple_sokoban": ("sokoban", {}),
    "larger_sokoban": ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}),
    "sokoban_different_grid_vocab": ("sokoban", {"symbols": "different", "search_depth": 30}),
    "metamathqa": ("qa", {}),
    "bandit_test": ("bandit", {"names": "test"}),
    # RAGEN-2 (April 2026): CoordSokoban is its default train tag; its FrozenLake tags slip with success_rate 0.8.
    "coord_sokoban": ("sokoban", {"observation_format": "grid_coord"}),
    "coord_frozenlake": ("frozenlake", {"observation_format": "grid_coord", "success_rate": 0.8}),
    "2048": ("game_2048", {}),
    # RAGEN-2's Sudoku tags (their budgets, 20 and 30 actions, are in the prompt presets).
    "simple_sudoku": ("sudoku", {"difficulty": "easy", "render_format": "with_feedback"}),
    "medium_sudoku": ("sudoku", {"difficulty": "medium", "render_format": "with_feedback"}),
}


#: Entry-point group of installed env plug-ins (see the module docstring).
ENTRY_POINT_GROUP = "fastpo.envs"
_entry_points_loaded = False

#: Config key holding each built-in env's per-episode step limit; Bandit and Countdown end after one action.
STEP_LIMIT_KEYS = {"sokoban": "max_steps", "frozenlake": "max_steps", "game_2048": "max_steps", "sudoku": "max_steps",
                   "rubikscube": "max_steps", "qa": "max_attempts"}
#: Built-in envs whose ``max_steps`` is raised to the action budget when the config leaves it out.
_STEP_LIMITED = ("sokoban", "frozenlake", "game_2048", "sudoku", "rubikscube")
_ONE_ACTION_ENVS = frozenset({"bandit", "countdown"})


def load_plugins(modules: Any) -> list[str]:
    """Import env plug-in modules (each calls ``register`` at import); already imported ones are kept.

    Args:
        modules: module names, as a sequence or one comma-separated str (``"my_envs,other.envs"``).
    Returns the module names. Raises ValueError naming the module when one cannot be imported."""
    if isinstance(modules, str):
        modules = [m for m in modules.split(",")]
    names = [m.strip() for m in modules if isinstance(m, str) and m.strip()]
    if len(names) != len(list(modules)):
        raise ValueError(f"plug-in modules must be non-empty module names, got {list(modules)!r}")
    for module in names:
        try:
            importlib.import_module(module)
        except (Exception, SystemExit) as e:  # the plug-in's own failure; sys.exit() there must not end the program
            what = (f"SystemExit: the module called sys.exit({e.code!r})" if isinstance(e, SystemExit)
                    else f"{type(e).__name__}: {e}")
            raise ValueError(f"env plug-in module {module!r} could not be imported: {what} "
                             "(is its folder on PYTHONPATH?)") from e
    return names


def _load_entry_points() -> None:
    """Import the ``fastpo.envs`` entry points of installed packages, once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # before loading: a plug-in calling available() must not recurse
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not inspect.ismodule(obj):
                obj()
        except (Exception, SystemExit) as e:  # sys.exit() in a plug-in must not end the program
            what = (f"SystemExit: it called sys.exit({e.code!r})" if isinstance(e, SystemExit)
                    else f"{type(e).__name__}: {e}")
            raise ValueError(f"env plug-in entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) "
                             f"failed: {what}") from e


def available() -> list[str]:
    """Names accepted by ``make``."""
    _load_entry_points()
    return sorted(set(_REGISTRY) | set(_ALIASES))


def is_builtin(name: str) -> bool:
    """True for fastpo's own env names and RAGEN-named presets (their prompts are RAGEN's, ``fastpo.prompts``);
    False for envs added with ``register`` (their prompt comes from the env, ``TextBatchEnv.prompt_fields``)."""
    _load_entry_points()
    key = name.lower()
    return key in _BUILTIN or key in _ALIASES


def base_name(name: str) -> str:
    """The registry name behind a preset alias (``larger_sokoban`` -> ``sokoban``); other names lowercased."""
    key = name.lower()
    return _ALIASES[key][0] if key in _ALIASES else key


def step_limit_config(name: str, budget: int, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the env's per-episode step limit raised to an action budget the prompt will promise.

    A built-in grid env's ``max_steps`` (default 10) is raised to ``budget`` when the config does not set it; a
    limit set in ``config`` (or QA's ``max_attempts``, or a plug-in's ``max_steps``) below the budget is refused,
    as is a budget above 1 for Bandit / Countdown (one action per episode): otherwise the episode would stop
    early while the prompt says "You have {budget} actions left". Raises ValueError naming the env and both
    numbers."""
    base = base_name(name)
    if base in _ONE_ACTION_ENVS:
        if budget > 1:
            raise ValueError(f"env {name!r}: an episode ends after one action, so its action budget must be 1, "
                             f"got {budget}")
        return dict(config)
    key = STEP_LIMIT_KEYS.get(base, "max_steps")
    if key in config:
        limit = config[key]
    elif base in _STEP_LIMITED:
        return {**config, key: max(budget, _default_step_limit(name))}
    elif base == "qa":
        limit = 1
    else:  # a plug-in: the max_steps it was registered with (None = unlimited)
        target = _REGISTRY.get(base, {}).get("python")
        limit = getattr(target, "default_max_steps", None)
    if limit is not None and isinstance(limit, int) and limit < budget:
        raise ValueError(f"env {name!r}: its step limit {key}={limit} is below the action budget {budget}, so the "
                         f"episode would stop before the prompt's budget is used; raise {key} to >= {budget} or "
                         f"lower max_actions_per_traj")
    return dict(config)


def _default_step_limit(name: str) -> int:
    key = name.lower()
    preset = _ALIASES[key][1] if key in _ALIASES else {}
    from .game2048 import Game2048Config
    from .layouts import FrozenLakeConfig, SokobanConfig
    from .rubiks import RubiksConfig
    from .sudoku import SudokuConfig

    cls = {"sokoban": SokobanConfig, "frozenlake": FrozenLakeConfig, "game_2048": Game2048Config,
           "sudoku": SudokuConfig, "rubikscube": RubiksConfig}[base_name(name)]
    return int(preset.get("max_steps", cls.max_steps))


def make(name: str, num_envs: int, backend: str = "default", **config: Any) -> BatchEnv:
    """Create a batch env.

    Args:
        name: one of ``available()``.
        num_envs: number of instances stepped together.
        backend: ``"default"`` (C++ where it exists), ``"cpp"`` or ``"python"``.
        **config: fields of the env's config dataclass (unknown keys raise ValueError).
    """
    if not isinstance(name, str) or name.lower() not in available():
        import difflib

        close = difflib.get_close_matches(str(name).lower(), available(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown env name {name!r}; accepted: {available()}{hint}")
    key = name.lower()
    if key in _ALIASES:
        key, preset = _ALIASES[key]
        config = {**preset, **config}
    backends = _REGISTRY[key]
    if backend == "default":
        backend = "cpp" if "cpp" in backends else "python"
    if backend not in backends:
        raise ValueError(f"backend {backend!r} is not available for env {name!r}; accepted: {sorted(backends)}")
    target = backends[backend]
    if isinstance(target, str):
        module_name, cls_name = target.split(":")
        target = getattr(importlib.import_module(module_name), cls_name)
    return target(num_envs, **config)


def register(name: str, factory: Callable[..., Any], *, max_steps: int | None = None, overwrite: bool = False) -> None:
    """Make a user's text env available as ``make(name, num_envs, **config)``.

    Args:
        name: registry name (case-insensitive); built-in names cannot be replaced.
        factory: ``factory(**config)`` returns one fresh ``TextEnv`` instance (typically the class).
        max_steps: default per-episode step budget (``truncated`` when used up); ``make(...,
            max_steps=k)`` overrides it, so ``max_steps`` is not passed on to ``factory``.
        overwrite: allow replacing an earlier ``register`` of the same name.
    """
    from .text import TextBatchEnv

    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"env name must be a non-empty str, got {name!r}")
    key = name.lower()
    if key in _BUILTIN or key in _ALIASES:
        raise ValueError(f"{name!r} is a built-in env name; choose another")
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"env {name!r} is already registered; pass overwrite=True to replace it")
    if not callable(factory):
        raise ValueError(f"factory must be callable (a TextEnv class or function), got {factory!r}")
    default_max_steps = max_steps

    def make_text_env(num_envs: int, max_steps: int | None = default_max_steps, **config: Any) -> TextBatchEnv:
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # some builtins have no signature: let the factory check
            signature = None
        if signature is not None:
            try:
                signature.bind(**config)
            except TypeError as e:
                raise ValueError(f"config {sorted(config)} does not fit env {name!r} ({factory!r}): {e}") from None
        return TextBatchEnv(num_envs, lambda: factory(**config), max_steps=max_steps, name=key)

    make_text_env.default_max_steps = default_max_steps  # read by step_limit_config
    _REGISTRY[key] = {"python": make_text_env}


__all__ = ["BatchEnv", "ENTRY_POINT_GROUP", "INFO_KEYS", "available", "base_name", "is_builtin", "load_plugins",
           "make", "register", "step_limit_config"]
