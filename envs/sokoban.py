"""Sokoban on the C++ batch simulator (``fastpo._C.SokobanBatch``): RAGEN's levels and gym-sokoban's rules.

    env = SokobanEnv(64, dim_room=(6, 6), num_boxes=1, num_threads=4)
    obs = env.reset(np.arange(64))                     # list of 64 text grids
    obs, reward, terminated, truncated, info = env.step(np.full(64, 4, dtype=np.int32))

Results equal the pure-Python twin ``PySokobanEnv`` (``envs/py_sokoban.py``, the specification) exactly;
a level depends only on ``(seed, config)``. Generation and stepping run without the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .grid import CppGridEnv
from .layouts import (
    OBSERVATION_FORMATS,
    SOKOBAN_ACTIONS,
    SOKOBAN_INSTRUCTION,
    SOKOBAN_SYMBOLS,
    SokobanConfig,
    parse_sokoban_layouts,
    sokoban_grid_vocab,
)


class SokobanEnv(CppGridEnv):
    """``num_envs`` Sokoban instances (actions 1 Up, 2 Down, 3 Left, 4 Right; others are "no valid action").

    Config: see ``SokobanConfig`` (dim_room, num_boxes, search_depth, max_steps, symbols, num_threads,
    p_change_directions, num_gen_steps, observation_format). Rewards: -0.1 per valid action, +1 / -1 for a
    box pushed onto / off a target, +10 when all boxes are on targets (terminated). ``truncated`` after
    ``max_steps`` valid actions. ``reset``, ``step``, ``render`` as ``CppGridEnv``. State key: FNV-1a 64 of
    room_fixed then room_state (walls, targets, boxes, player; not the step counter): equal states give equal
    keys at any turn. ``get_state``: room_fixed/room_state ``uint8[N, R, C]``, num_steps/boxes_on_target
    ``int32[N]``, terminated/truncated ``bool[N]``.
    """

    name = "sokoban"
    action_names = SOKOBAN_ACTIONS
    instruction_text = SOKOBAN_INSTRUCTION
    config_cls = SokobanConfig
    config: SokobanConfig

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        from fastpo import _C  # imported after the config is built, so its errors never need the extension

        cfg = self.config
        self.grid_vocab = sokoban_grid_vocab(cfg.symbols)
        self._batch = _C.SokobanBatch(
            self.num_envs,
            cfg.dim_room[0],
            cfg.dim_room[1],
            cfg.num_boxes,
            cfg.search_depth,
            cfg.max_steps,
            list(SOKOBAN_SYMBOLS[cfg.symbols]),
            cfg.num_threads,
            float(cfg.p_change_directions),
            cfg.gen_steps,
            OBSERVATION_FORMATS[cfg.observation_format],
        )

    def reset_from_layouts(self, layouts: Sequence[str | Sequence[str]]) -> list[str]:
        """Start every instance from a text grid in the default symbols ``# _ O √ X P S``.

        A layout may hold boxes already on targets; the +1/-1 rewards then count from the actual number on
        targets (RAGEN starts its counter at 0). Raises ValueError naming env, row and column of bad input.
        """
        fixed, state = parse_sokoban_layouts(layouts, self.num_envs, self.config.dim_room)
        return self._batch.set_layouts(fixed, state)

    def solve(self, max_depth: int = 100) -> list[list[int] | None]:
        """Optimal action ids per instance from its current state (see ``solvers.solve_sokoban``)."""
        from .solvers import solve_sokoban

        state = self.get_state()
        return [solve_sokoban(f, s, max_depth) for f, s in zip(state["room_fixed"], state["room_state"], strict=True)]
