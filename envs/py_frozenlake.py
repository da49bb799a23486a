"""Pure-Python FrozenLake: the test oracle and the speed baseline of the C++ env (``fastpo.envs.frozenlake``).

Maps are RAGEN's ``generate_random_map`` with ``CounterRng(seed, STREAM_FROZENLAKE_GEN)``; stepping is
gymnasium's FrozenLake (RAGEN ids 1 Left, 2 Down, 3 Right, 4 Up = gym 0..3). On slippery ice the gym
direction actually taken is ``[(a - 1) % 4, a, (a + 1) % 4][k]``, where ``slip`` is
``CounterRng(seed, STREAM_FROZENLAKE_SLIP)`` restarted at every reset (one draw per valid action) and

- gym's slip (``success_rate=None``): ``k = slip.randint(3)``;
- RAGEN-2's slip (``success_rate=p``): ``k`` is gym's ``categorical_sample`` over ``[f, p, f]`` with
  ``f = (1 - p) / 2``: ``u = slip.uniform()``, k = 0 if ``u < f``, else 1 if ``u < f + p``, else 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import check_seeds, fnv1a64
from .grid import PyGridEnv
from .layouts import (
    FROZENLAKE_ACTIONS,
    FROZENLAKE_GRID_VOCAB,
    FROZENLAKE_INSTRUCTION,
    FROZENLAKE_MAX_MAP_TRIES,
    FrozenLakeConfig,
    format_observation,
    frozenlake_coord_text,
    parse_frozenlake_layouts,
)
from .rng import STREAM_FROZENLAKE_GEN, STREAM_FROZENLAKE_SLIP, CounterRng

# gym action -> (row change, col change): 0 Left, 1 Down, 2 Right, 3 Up.
GYM_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))


def generate_random_map(seed: int, size: int = 4, p: float = 0.8) -> list[str]:
    """RAGEN's generate_random_map: ``size`` row strings of ``S F H G`` with the goal reachable from S."""
    rng = CounterRng(seed, STREAM_FROZENLAKE_GEN)
    for _ in range(FROZENLAKE_MAX_MAP_TRIES):
        board = [["F" if rng.uniform() < p else "H" for _ in range(size)] for _ in range(size)]
        start_r, start_c = rng.randint(size), rng.randint(size)
        goal_r, goal_c = rng.randint(size), rng.randint(size)
        if (start_r, start_c) != (goal_r, goal_c):
            board[start_r][start_c], board[goal_r][goal_c] = "S", "G"
            if is_valid(board, size):
                return ["".join(row) for row in board]
    raise RuntimeError(f"no FrozenLake map with a reachable goal for seed {seed} (size={size}, p={p})")


def is_valid(board: list[list[str]], size: int) -> bool:
    """Whether G is reachable from S through non-hole cells (4-neighbour)."""
    start = next((r, c) for r in range(size) for c in range(size) if board[r][c] == "S")
    frontier, discovered = [start], set()
    while frontier:
        r, c = frontier.pop()
        if (r, c) in discovered:
            continue
        discovered.add((r, c))
        for dr, dc in ((1, 0), (0, 1), (-1, 0), (0, -1)):
            rn, cn = r + dr, c + dc
            if 0 <= rn < size and 0 <= cn < size:
                if board[rn][cn] == "G":
                    return True
                if board[rn][cn] != "H":
                    frontier.append((rn, cn))
    return False


#: render: a tile's symbol, and the player's on a hole / the goal (else "P")
_TILE = {"S": "_", "F": "_", "H": "O", "G": "G"}
_PLAYER_ON = {"H": "X", "G": "√"}


class FrozenLakeGame:
    """One FrozenLake instance: ``desc`` ``uint8[S, S]`` ASCII ``S F H G``, player cell ``row * S + col``."""

    def __init__(self, desc: np.ndarray, start: int, seed: int, is_slippery: bool, max_steps: int,
                 success_rate: float | None = None):
        self.desc = desc.astype(np.uint8)
        self.size = desc.shape[0]
        self.position = int(start)
        self.slip = CounterRng(seed, STREAM_FROZENLAKE_SLIP)
        self.is_slippery = is_slippery
        self.success_rate = success_rate
        self.max_steps = max_steps
        self.num_steps = 0
        self.terminated = False
        self.truncated = False

    def letter(self) -> str:
        return chr(self.desc.flat[self.position])

    def step(self, action: int) -> tuple[float, bool, bool]:
        """Returns ``(reward, action_is_valid, action_is_effective)``."""
        if self.terminated or self.truncated or not 1 <= action <= 4:
            return 0.0, False, False
        self.num_steps += 1
        gym_action = action - 1
        if self.is_slippery:
            if self.success_rate is None:
                k = self.slip.randint(3)
            else:
                fail = (1.0 - self.success_rate) / 2.0
                u = self.slip.uniform()
                k = 0 if u < fail else 1 if u < fail + self.success_rate else 2
            gym_action = [(gym_action - 1) % 4, gym_action, (gym_action + 1) % 4][k]
        row, col = divmod(self.position, self.size)
        dr, dc = GYM_MOVES[gym_action]
        row = min(max(row + dr, 0), self.size - 1)  # moving off the map leaves the player in place
        col = min(max(col + dc, 0), self.size - 1)
        old = self.position
        self.position = row * self.size + col
        letter = self.letter()
        reward = 1.0 if letter == "G" else 0.0
        self.terminated = letter in "GH"
        self.truncated = not self.terminated and self.num_steps >= self.max_steps
        return reward, True, self.position != old

    def render(self) -> str:
        # one tolist() instead of a numpy scalar per cell: the twin renders after every step of thousands of episodes
        cells = [_TILE[chr(v)] for v in self.desc.ravel().tolist()]
        cells[self.position] = _PLAYER_ON.get(chr(int(self.desc.flat[self.position])), "P")
        n = self.size
        return "\n".join("".join(cells[r * n:(r + 1) * n]) for r in range(n))


class PyFrozenLakeEnv(PyGridEnv):
    """Batch of pure-Python FrozenLake instances; same API, config and results as ``FrozenLakeEnv`` (C++).

    Config: see ``FrozenLakeConfig`` (``num_threads`` is accepted and ignored).
    """

    name = "frozenlake"
    action_names = FROZENLAKE_ACTIONS
    grid_vocab = FROZENLAKE_GRID_VOCAB
    instruction_text = FROZENLAKE_INSTRUCTION
    config_cls = FrozenLakeConfig
    config: FrozenLakeConfig
    _state_fields = {
        "desc": (lambda g: g.desc, None),
        "position": (lambda g: g.position, np.int32),
        "slip_draws": (lambda g: g.slip.counter, np.int64),
    }

    def _new_game(self, seed: int) -> FrozenLakeGame:
        cfg = self.config
        rows = generate_random_map(seed, cfg.size, cfg.p)
        desc = np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8).reshape(cfg.size, cfg.size)
        start = int(np.flatnonzero(desc.ravel() == ord("S"))[0])
        return FrozenLakeGame(desc, start, seed, cfg.is_slippery, cfg.max_steps, cfg.success_rate)

    def reset_from_layouts(
        self, layouts: Sequence[str | Sequence[str]], seeds: Sequence[int] | np.ndarray | None = None
    ) -> list[str]:
        """Start every instance from a gymnasium-style map (see ``parse_frozenlake_layouts``).

        ``seeds`` (``int64[num_envs]``, default all 0) seed the slip streams only."""
        desc, start = parse_frozenlake_layouts(layouts, self.num_envs, self.config.size)
        seeds = check_seeds(np.zeros(self.num_envs, dtype=np.int64) if seeds is None else seeds, self.num_envs)
        cfg = self.config
        self.games = [
            FrozenLakeGame(desc[i], int(start[i]), int(seeds[i]), cfg.is_slippery, cfg.max_steps, cfg.success_rate)
            for i in range(self.num_envs)
        ]
        return self.render()

    def solve(self) -> list[list[int] | None]:
        """Shortest path per instance from its current cell (see ``solvers.solve_frozenlake``)."""
        from .solvers import solve_frozenlake

        return [solve_frozenlake(g.desc, g.position) for g in self._games()]

    def _success(self, game: FrozenLakeGame) -> bool:
        return game.letter() == "G"

    def _render_game(self, game: FrozenLakeGame) -> str:
        fmt = self.config.observation_format
        if fmt == "grid":
            return game.render()
        return format_observation(fmt, game.render(), frozenlake_coord_text(game.desc, game.position))

    def _state_key(self, game: FrozenLakeGame) -> int:
        """FNV-1a 64 of the map bytes then the player cell (int32 little-endian), as ``FrozenLakeEnv``."""
        return fnv1a64(game.position.to_bytes(4, "little"), fnv1a64(game.desc.tobytes()))

