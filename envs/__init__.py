"""fastpo.envs: batched environments with RAGEN's rules.

    env = fastpo.envs.make("sokoban", num_envs=64, dim_room=(6, 6), num_boxes=1)
    obs = env.reset(np.arange(64))
    obs, reward, terminated, truncated, info = env.step(np.full(64, 1, dtype=np.int32))

Sokoban and FrozenLake run in the C++ batch simulator (``fastpo._C``); ``backend="python"`` selects
their pure-Python twins (the test oracle and the speed baseline). Bandit, Countdown and the QA env
are Python; users' own text environments plug in through ``fastpo.envs.text`` (see ``TextEnv``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import INFO_KEYS, BatchEnv

# name -> {backend: "module:Class"}; modules are imported lazily so a missing optional piece
# (e.g. the C++ extension during a source checkout) only fails for the env that needs it.
_REGISTRY: dict[str, dict[str, str]] = {
    "sokoban": {"cpp": "fastpo.envs.sokoban:SokobanEnv", "python": "fastpo.envs.py_sokoban:PySokobanEnv"},
    "frozenlake": {
        "cpp": "fastpo.envs.frozenlake:FrozenLakeEnv",
        "python": "fastpo.envs.py_frozenlake:PyFrozenLakeEnv",
    },
    "bandit": {"python": "fastpo.envs.bandit:BanditEnv"},
    "countdown": {"python": "fastpo.envs.countdown:CountdownEnv"},
    "qa": {"python": "fastpo.envs.qa:QAEnv"},
}

# Preset configurations under their RAGEN names.
_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "simple_sokoban": ("sokoban", {}),
    "larger_sokoban": ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}),
    "sokoban_different_grid_vocab": ("sokoban", {"symbols": "different"}),
    "metamathqa": ("qa", {}),
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
    module_name, cls_name = backends[backend].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(num_envs, **config)


__all__ = ["BatchEnv", "INFO_KEYS", "available", "make"]
