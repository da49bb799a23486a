"""The 2x2 Rubik's cube on the C++ batch simulator (``fastpo._C.RubiksBatch``): RAGEN-2's ``rubikscube`` env.

    env = RubiksEnv(16, scramble_depth=1)                   # RAGEN's rubikscube tag
    obs = env.reset(np.arange(16))
    obs, reward, terminated, truncated, info = env.step(np.full(16, 2, dtype=np.int32))   # everyone turns U'

State: 24 stickers, 4 per face in the order U, L, F, R, B, D, colours W O G R B Y (0..5). A turn permutes them
as RAGEN's code does (``TURNS``: U, D, L, R, F, B clockwise; a prime turn is three clockwise turns). ``reset``
scrambles a solved cube with ``scramble_depth`` turns drawn from ``CounterRng(seed, STREAM_RUBIKS)``
(``randint(12) + 1`` each). Every turn is valid and effective; reward 1.0 and ``terminated`` when each face has
one colour; ``truncated`` after ``max_steps`` turns.

The observation is the text RAGEN's env renders when it is asked for its state (``render()`` without arguments,
what RAGEN's env manager puts in the prompt): the step counter, the six faces and the list of actions. (RAGEN's
``step`` also returns a "Game Over" variant, which the manager does not show.)

Results equal the pure-Python twin ``PyRubiksEnv`` (``envs/py_rubiks.py``) exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .grid import CppGridEnv
from .layouts import _check_int
from .prompt_text import RUBIKS_ACTIONS, RUBIKS_INSTRUCTION

#: RAGEN's quarter turns U, D, L, R, F, B: after a turn, sticker k holds the one that was at TURNS[face][k].
TURNS = (
    (2, 0, 3, 1, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 4, 5, 18, 19, 20, 21, 22, 23),
    (0, 1, 2, 3, 4, 5, 18, 19, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 22, 20, 23, 21),
    (19, 1, 17, 3, 6, 4, 7, 5, 0, 9, 2, 11, 12, 13, 14, 15, 16, 22, 18, 20, 8, 21, 10, 23),
    (0, 9, 2, 11, 4, 5, 6, 7, 8, 21, 10, 23, 14, 12, 15, 13, 3, 17, 1, 19, 20, 18, 22, 16),
    (0, 1, 7, 5, 4, 20, 6, 21, 10, 8, 11, 9, 2, 13, 3, 15, 16, 17, 18, 19, 14, 12, 22, 23),
    (13, 15, 2, 3, 1, 5, 0, 7, 8, 9, 10, 11, 12, 22, 14, 23, 18, 16, 19, 17, 20, 21, 6, 4),
)


@dataclasses.dataclass
class RubiksConfig:
    """2x2 cube config (RAGEN-2's RubiksCube2x2Config; its rubikscube tag sets scramble_depth 1)."""

    scramble_depth: int = 5
    """Random turns that scramble the solved cube at reset; [0, 1000]."""
    max_steps: int = 20
    """Turn budget: truncated after this many turns."""
    num_threads: int = 1
    """Worker threads of the C++ batch (1 = run in the calling thread); the Python twin ignores it."""

    def __post_init__(self):
        _check_int("scramble_depth", self.scramble_depth, 0, 1000)
        _check_int("max_steps", self.max_steps, 1, 2**31 - 1)
        _check_int("num_threads", self.num_threads, 1, 256)


def check_cubes(stickers: Any, num_envs: int) -> np.ndarray:
    """Cubes for ``reset_from_cubes``: ``uint8[num_envs, 24]`` colours 0..5, each colour on 4 stickers."""
    arr = np.asarray(stickers)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer) or arr.shape != (num_envs, 24):
        raise ValueError(f"cubes must be integers of shape ({num_envs}, 24), got {arr.dtype} {arr.shape}")
    for i, cube in enumerate(arr):
        counts = np.bincount(np.clip(cube, 0, 6), minlength=7)
        if cube.min() < 0 or cube.max() > 5 or not (counts[:6] == 4).all():
            raise ValueError(f"cube of env {i}: colours must be 0..5 with 4 stickers each, got {cube.tolist()}")
    return np.ascontiguousarray(arr, dtype=np.uint8)


class RubiksEnv(CppGridEnv):
    """``num_envs`` 2x2 cubes (actions 1 U, 2 U', 3 D, 4 D', 5 L, 6 L', 7 R, 8 R', 9 F, 10 F', 11 B, 12 B', RAGEN's
    ids; others are "no valid action"). Config: see ``RubiksConfig``. State key: FNV-1a 64 of the 24 stickers.
    ``get_state``: stickers ``uint8[N, 24]``, num_steps ``int32[N]``, terminated/truncated ``bool[N]``."""

    name = "rubikscube"
    action_names = RUBIKS_ACTIONS
    instruction_text = RUBIKS_INSTRUCTION
    config_cls = RubiksConfig
    config: RubiksConfig

    # Like the other wrappers' __init__ by shape only: each hands its own config fields to its own _C class.
    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        from fastpo import _C

        cfg = self.config
        self._batch = _C.RubiksBatch(self.num_envs, cfg.scramble_depth, cfg.max_steps, cfg.num_threads)

    def reset_from_cubes(self, stickers: Any) -> list[str]:
        """Start every instance from given stickers (see ``check_cubes``)."""
        return self._batch.set_cubes(check_cubes(stickers, self.num_envs))
