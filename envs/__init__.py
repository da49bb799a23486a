"""fastpo.envs: batched environments with RAGEN's rules.

    env = fastpo.envs.make("sokoban", num_envs=64, dim_room=(6, 6), num_boxes=1)
    obs = env.reset(np.arange(64))
    obs, reward, terminated, truncated, info = env.step(np.full(64, 1, dtype=np.int32))

Sokoban and FrozenLake run in the C++ batch simulator (``fastpo._C``); ``backend="python"`` selects
their pure-Python twins (the test oracle and the speed baseline). Bandit, Countdown and the QA env
are Python; users' own text environments plug in through ``fastpo.envs.text`` (see ``TextEnv``) and
``register(name, factory)``, which makes them available to ``make`` (docs/ENVS.md).
"""

from __future__ import annotations

import importlib
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
}


def available() -> list[str]:
    """Names accepted by ``make``."""
    return sorted(set(_REGISTRY) | set(_ALIASES))


def make(name: str, num_envs: int, backend: str = "default", **config: Any) -> BatchEnv:
    """Create a batch env.

    Args:
        name: one of ``available()``.
        num_envs: number of instances stepped together.
        backend: ``"default"`` (C++ where it exists), ``"cpp"`` or ``"python"``.
        **config: fields of the env's config dataclass (unknown keys raise ValueError).
    """
    if not isinstance(name, str) or name.lower() not in available():
        raise ValueError(f"unknown env name {name!r}; accepted: {available()}")
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

    _REGISTRY[key] = {"python": make_text_env}


__all__ = ["BatchEnv", "INFO_KEYS", "available", "make", "register"]
