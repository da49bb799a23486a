"""2048 on the C++ batch simulator (``fastpo._C.Game2048Batch``): RAGEN-2's ``game_2048`` env.

    env = Game2048Env(64)                                  # 4x4 boards, RAGEN's defaults
    obs = env.reset(np.arange(64))                         # "Current 2048 Grid:\\nRow 1: [0, 2, 0, 0]\\n..."
    obs, reward, terminated, truncated, info = env.step(np.full(64, 1, dtype=np.int32))   # everyone slides Up

Rules (RAGEN's): a move slides every line toward one wall and merges equal neighbours once, left to right in
slide order; a move that changes the board spawns a tile (a 2 w.p. ``two_prob``, else a 4) on a uniformly
chosen empty cell. Reward with ``use_log_reward`` (RAGEN's default): ``0.1 * log2(merged + 1)`` when the move
merged tiles summing to ``merged``, else 0; without it, the merged sum, and -0.1 for a move that moves nothing.
A move that moves nothing is not valid (``action_is_valid`` and ``action_is_effective`` False) but still costs a
step. The game ends (``terminated``) when a move leaves no empty cell and no move; ``success`` = it ended with a
2048 tile. ``truncated`` after ``max_steps`` steps. Spawns come from ``CounterRng(seed, STREAM_GAME2048)``,
restarted at every reset: draw ``randint(number of empty cells)`` then ``uniform() < two_prob``.

Results equal the pure-Python twin ``PyGame2048Env`` (``envs/py_game2048.py``, the specification) exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import check_seeds
from .grid import CppGridEnv
from .layouts import _check_float, _check_int
from .prompt_text import GAME2048_ACTIONS, GAME2048_INSTRUCTION

GAME2048_MAX_SIZE = 6


# Shaped like the other env configs (a field and its docstring each, checks in __post_init__); the fields are 2048's.
@dataclasses.dataclass
class Game2048Config:
    """2048 env config (RAGEN-2's Game2048EnvConfig)."""

    size: int = 4
    """Side of the square board; [2, 6]."""
    two_prob: float = 0.9
    """Probability in [0, 1] that a spawned tile is a 2 (else a 4)."""
    use_log_reward: bool = True
    """RAGEN's log reward ``0.1 * log2(merged + 1)``; False: the merged sum, -0.1 for a move that moves nothing."""
    max_steps: int = 700
    """Per-episode action budget (RAGEN's tag: max_actions_per_traj 700): truncated after this many steps."""
    num_threads: int = 1
    """Worker threads of the C++ batch (1 = run in the calling thread); the Python twin ignores it."""

    def __post_init__(self):
        _check_int("size", self.size, 2, GAME2048_MAX_SIZE)
        _check_float("two_prob", self.two_prob, 0.0, 1.0)
        self.two_prob = float(self.two_prob)
        if not isinstance(self.use_log_reward, (bool, np.bool_)):
            raise ValueError(f"use_log_reward must be a bool, got {self.use_log_reward!r}")
        self.use_log_reward = bool(self.use_log_reward)
        _check_int("max_steps", self.max_steps, 1, 2**31 - 1)
        _check_int("num_threads", self.num_threads, 1, 256)


def check_boards(tiles: Any, num_envs: int, size: int) -> np.ndarray:
    """Boards for ``reset_from_boards``: ``int64[num_envs, size, size]`` of 0 (empty) or powers of two in
    [2, 2^40]. Raises ValueError naming the env, row and column of the first bad value."""
    arr = np.asarray(tiles)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"boards must be integers (int64[{num_envs}, {size}, {size}]), got dtype {arr.dtype}")
    if arr.shape != (num_envs, size, size):
        raise ValueError(f"boards must have shape ({num_envs}, {size}, {size}), got {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    bad = (arr != 0) & ((arr < 2) | (arr > 2**40) | ((arr & (arr - 1)) != 0))
    if bad.any():
        i, r, c = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"board of env {i}: row {r}, column {c} holds {arr[i, r, c]}; tiles are 0 (empty) or a "
                         "power of two in [2, 2^40]")
    return arr


class Game2048Env(CppGridEnv):
    """``num_envs`` 2048 boards (actions 1 Up, 2 Right, 3 Down, 4 Left: RAGEN's ids 0..3 plus one; others are "no
    valid action"). Config: see ``Game2048Config``. ``reset``, ``step``, ``render`` as ``CppGridEnv``. State key:
    FNV-1a 64 of the tile exponents (one byte per cell, 0 empty) then the score (int64 little-endian).
    ``get_state``: grid ``int64[N, S, S]`` (tile values), score ``int64[N]``, num_steps ``int32[N]``, spawn_draws
    ``int64[N]``, terminated/truncated ``bool[N]``.
    """

    name = "game_2048"
    action_names = GAME2048_ACTIONS
    instruction_text = GAME2048_INSTRUCTION
    max_actions_per_turn = 5
    config_cls = Game2048Config
    config: Game2048Config

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        from fastpo import _C

        cfg = self.config
        self._batch = _C.Game2048Batch(self.num_envs, cfg.size, cfg.two_prob, cfg.use_log_reward, cfg.max_steps,
                                       cfg.num_threads)

    def reset_from_boards(self, tiles: Any, seeds: Sequence[int] | np.ndarray | None = None) -> list[str]:
        """Start every instance from a board (see ``check_boards``); ``seeds`` (default all 0) start the spawn
        streams. The score starts at 0."""
        tiles = check_boards(tiles, self.num_envs, self.config.size)
        seeds = check_seeds(np.zeros(self.num_envs, dtype=np.int64) if seeds is None else seeds, self.num_envs)
        return self._batch.set_boards(tiles, seeds)
