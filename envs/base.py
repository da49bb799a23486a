"""The batch environment interface every fastpo env implements, and the input checks they share.

A batch env holds ``num_envs`` independent instances. Discrete envs (Sokoban, FrozenLake, Bandit)
take ``int32[num_envs]`` action ids; text envs (Countdown, QA, users' own) take ``list[str]``.
Nothing resets by itself: a finished instance stays finished (stepping it is a no-op that reports
``terminated``/``truncated`` again with reward 0) until ``reset`` is called for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Keys of the ``info`` dict returned by ``step``; each value is ``bool[num_envs]``.
INFO_KEYS = ("success", "action_is_valid", "action_is_effective")

StepResult = tuple[list[str], np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]


class BatchEnv(ABC):
    """``num_envs`` instances of one environment stepped together.

    Attributes:
        name: registry name (``"sokoban"``, ...).
        num_envs: number of instances.
        action_space: ``"discrete"`` (ids, ``action_names[i - 1]`` names id ``i``; 0 = no valid action)
            or ``"text"`` (free text, e.g. a Countdown equation).
        action_names: discrete action names in id order (empty for text envs).
        max_actions_per_turn: RAGEN's per-turn cap for this env (the parser keeps at most this many).
    """

    name: str = ""
    action_space: str = "discrete"
    action_names: list[str] = []
    max_actions_per_turn: int = 5

    def __init__(self, num_envs: int):
        self.num_envs = check_num_envs(num_envs)

    @abstractmethod
    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        """Start new episodes. ``seeds``: ``int64[num_envs]``; ``mask``: optional ``bool[num_envs]``,
        only instances where it is True are reset (the others keep their state). Returns all
        ``num_envs`` observations."""

    @abstractmethod
    def step(self, actions: Any) -> StepResult:
        """Apply one action per instance. Returns ``(obs, reward float32[N], terminated bool[N],
        truncated bool[N], info)`` with ``info`` holding the ``bool[N]`` arrays of ``INFO_KEYS``.

        Grid envs (Sokoban, FrozenLake) also take ``render=False``: ``obs`` is then None. A rollout
        executes several actions per turn and shows the model only the state after the last one."""

    @abstractmethod
    def render(self) -> list[str]:
        """Current text observation of every instance."""

    @abstractmethod
    def instruction(self) -> str:
        """The env's task description for the first user message (rules, symbol legend)."""

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release resources (nothing to do for most envs)."""

    def state_keys(self) -> np.ndarray:
        """``uint64[num_envs]``: a key of each instance's current state, equal for equal states (GiGPO's anchor
        states). Default: :func:`text_state_keys` of ``render()``; grid envs override it with an exact key of
        their state."""
        return text_state_keys(self.render())


_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a64(data: bytes, h: int = _FNV_OFFSET) -> int:
    """FNV-1a 64 of ``data``, continuing from ``h``: the grid envs' exact state key (csrc/state_key.h computes the
    same function)."""
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


def text_state_keys(observations: Sequence[str]) -> np.ndarray:
    """``uint64[len(observations)]``: the first 8 bytes (little-endian) of BLAKE2b of each observation's UTF-8 text;
    equal texts give equal keys, and distinct texts collide with probability ~2^-64 per pair."""
    return np.array([int.from_bytes(hashlib.blake2b(o.encode("utf-8"), digest_size=8).digest(), "little")
                     for o in observations], dtype=np.uint64)


def check_num_envs(num_envs: Any) -> int:
    if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
    return int(num_envs)


def check_seeds(seeds: Any, num_envs: int) -> np.ndarray:
    """Validate seeds: integer array-like of shape ``[num_envs]`` -> ``int64[num_envs]``."""
    arr = np.asarray(seeds)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"seeds must be integers (int64[{num_envs}]), got dtype {arr.dtype}")
    if arr.shape != (num_envs,):
        raise ValueError(f"seeds must have shape ({num_envs},), got {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"seeds must fit in int64, got {arr.max()}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_mask(mask: Any, num_envs: int) -> np.ndarray:
    """Validate a reset mask -> ``bool[num_envs]`` (None means all True)."""
    if mask is None:
        return np.ones(num_envs, dtype=bool)
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise ValueError(f"mask must be a bool array, got dtype {arr.dtype}")
    if arr.shape != (num_envs,):
        raise ValueError(f"mask must have shape ({num_envs},), got {arr.shape}")
    return np.ascontiguousarray(arr)


def check_discrete_actions(actions: Any, num_envs: int) -> np.ndarray:
    """Validate discrete actions: integer array of shape ``[num_envs]`` -> ``int32[num_envs]``.

    Out-of-range ids are accepted (they are "no valid action" for the env); the dtype and shape are
    what is checked, and values must fit in int32."""
    if (
        type(actions) is np.ndarray
        and actions.dtype == np.int32
        and actions.shape == (num_envs,)
        and actions.flags.c_contiguous
    ):
        return actions  # fast path: already exactly what the simulator takes (int32 always fits int32)
    if isinstance(actions, (list, tuple)) and any(isinstance(a, (bool, np.bool_)) for a in actions):
        raise ValueError("actions must be integer ids, got bool values")
    arr = np.asarray(actions)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"actions must be integer ids (int32[{num_envs}]), got dtype {arr.dtype}")
    if arr.shape != (num_envs,):
        raise ValueError(f"actions must have shape ({num_envs},), got {arr.shape}")
    if arr.size:
        info = np.iinfo(np.int32)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"actions must fit in int32 [{info.min}, {info.max}], got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def check_text_actions(actions: Any, num_envs: int, check_items: bool = True) -> list[str]:
    """Validate text actions: a list or tuple of ``num_envs`` strings -> a list. ``check_items=False`` leaves the
    check that each item is a str to the caller (the C++ Sudoku step does it, with the same message)."""
    if isinstance(actions, str) or not isinstance(actions, (list, tuple)):
        raise ValueError(f"actions must be a list of {num_envs} strings, got {type(actions).__name__}")
    if len(actions) != num_envs:
        raise ValueError(f"actions must have length {num_envs}, got {len(actions)}")
    if check_items:
        for i, a in enumerate(actions):
            if not isinstance(a, str):
                raise ValueError(f"actions[{i}] must be a str, got {type(a).__name__}")
    return actions if type(actions) is list else list(actions)


def build_config(config_cls: type, env_name: str, overrides: dict[str, Any]):
    """Instantiate a config dataclass from keyword overrides, rejecting unknown keys by name."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} for env {env_name!r}; accepted: {sorted(fields)}")
    return config_cls(**overrides)


def empty_info(num_envs: int) -> dict[str, np.ndarray]:
    return {k: np.zeros(num_envs, dtype=bool) for k in INFO_KEYS}
