"""FrozenLake on the C++ batch simulator (``fastpo._C.FrozenLakeBatch``): RAGEN's maps, gymnasium's rules, gym's
or RAGEN-2's slip, and RAGEN-2's coordinate observations.

    env = FrozenLakeEnv(64, size=4, p=0.8, is_slippery=True)
    obs = env.reset(np.arange(64))
    obs, reward, terminated, truncated, info = env.step(np.full(64, 3, dtype=np.int32))

Results equal the pure-Python twin ``PyFrozenLakeEnv`` (``envs/py_frozenlake.py``, the specification)
exactly. Slips come from ``CounterRng(seed, STREAM_FROZENLAKE_SLIP)``, restarted at every reset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import check_seeds
from .grid import CppGridEnv
from .layouts import (
    FROZENLAKE_ACTIONS,
    FROZENLAKE_GRID_VOCAB,
    FROZENLAKE_INSTRUCTION,
    OBSERVATION_FORMATS,
    FrozenLakeConfig,
    parse_frozenlake_layouts,
)


class FrozenLakeEnv(CppGridEnv):
    """``num_envs`` FrozenLake instances (actions 1 Left, 2 Down, 3 Right, 4 Up; others are "no valid action").

    Config: see ``FrozenLakeConfig`` (size, p, is_slippery, success_rate, observation_format, max_steps,
    num_threads). Reward 1.0 on reaching
    the goal; terminated on a hole or the goal; truncated after ``max_steps`` valid actions. ``reset``,
    ``step``, ``render`` as ``CppGridEnv``. State key: FNV-1a 64 of the map then the player cell (int32
    little-endian; not the step counter or the slip stream). ``get_state``: desc ``uint8[N, S, S]`` (ASCII),
    position/num_steps ``int32[N]``, slip_draws ``int64[N]``, terminated/truncated ``bool[N]``.
    """

    name = "frozenlake"
    action_names = FROZENLAKE_ACTIONS
    grid_vocab = FROZENLAKE_GRID_VOCAB
    instruction_text = FROZENLAKE_INSTRUCTION
    config_cls = FrozenLakeConfig
    config: FrozenLakeConfig

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        from fastpo import _C

        cfg = self.config
        success_rate = -1.0 if cfg.success_rate is None else cfg.success_rate  # negative: gym's 1/3 slip
        self._batch = _C.FrozenLakeBatch(
            self.num_envs, cfg.size, float(cfg.p), cfg.is_slippery, cfg.max_steps, cfg.num_threads, success_rate,
            OBSERVATION_FORMATS[cfg.observation_format],
        )

    def reset_from_layouts(
        self, layouts: Sequence[str | Sequence[str]], seeds: Sequence[int] | np.ndarray | None = None
    ) -> list[str]:
        """Start every instance from a gymnasium-style map of ``S F H G`` (list of rows or one string).

        ``seeds`` (``int64[num_envs]``, default all 0) seed the slip streams only. Raises ValueError naming
        env, row and column of bad input."""
        desc, start = parse_frozenlake_layouts(layouts, self.num_envs, self.config.size)
        seeds = check_seeds(np.zeros(self.num_envs, dtype=np.int64) if seeds is None else seeds, self.num_envs)
        return self._batch.set_layouts(desc, start, seeds)

    def solve(self) -> list[list[int] | None]:
        """Shortest path per instance from its current cell (see ``solvers.solve_frozenlake``)."""
        from .solvers import solve_frozenlake

        state = self.get_state()
        return [solve_frozenlake(d, int(p)) for d, p in zip(state["desc"], state["position"], strict=True)]
