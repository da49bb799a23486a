"""Pure-Python 2048: the test oracle and the speed baseline of the C++ env (``fastpo.envs.game2048``, whose
docstring states the rules). A board is a list of rows of tile values (0 = empty)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import check_seeds, fnv1a64
from .game2048 import Game2048Config, check_boards
from .grid import PyGridEnv
from .prompt_text import GAME2048_ACTIONS, GAME2048_INSTRUCTION
from .rng import STREAM_GAME2048, CounterRng

ACTION_TEXT = ("0(Up)", "1(Right)", "2(Down)", "3(Left)")  # RAGEN's ids and names in the observation


@functools.lru_cache(maxsize=1 << 16)
def _slide_left(line: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """One line slid to the left: tiles packed, equal neighbours merged once, left first; and the merged sum.
    Cached: boards repeat the same few lines, and the twin slides millions of them in the tests."""
    vals = [v for v in line if v]
    merged, merged_sum, k = [], 0, 0
    while k < len(vals):
        if k + 1 < len(vals) and vals[k] == vals[k + 1]:
            merged.append(vals[k] * 2)
            merged_sum += vals[k] * 2
            k += 2
        else:
            merged.append(vals[k])
            k += 1
    return tuple(merged) + (0,) * (len(line) - len(merged)), merged_sum


def slide(board: list[list[int]], direction: int) -> tuple[list[list[int]], int]:
    """``board`` after a move in RAGEN's direction (0 Up, 1 Right, 2 Down, 3 Left) and the merged sum."""
    # every move as a Left slide of lines: columns for Up / Down (transposed), reversed for Right / Down
    lines = zip(*board, strict=True) if direction in (0, 2) else board
    backwards = direction in (1, 2)
    out, merged_sum = [], 0
    for line in lines:
        merged, gained = _slide_left(tuple(line)[::-1] if backwards else tuple(line))
        merged_sum += gained
        out.append(list(merged[::-1] if backwards else merged))
    return ([list(row) for row in zip(*out, strict=True)] if direction in (0, 2) else out), merged_sum


class Game2048:
    """One board and its episode state."""

    def __init__(self, board: list[list[int]], seed: int, config: Game2048Config, spawn_two: bool):
        self.board = board
        self.config = config
        self.rng = CounterRng(seed, STREAM_GAME2048)
        self.score = 0
        self.num_steps = 0
        self.terminated = False
        self.truncated = False
        if spawn_two:
            self.spawn()
            self.spawn()

    def spawn(self) -> None:
        empty = [(r, c) for r, row in enumerate(self.board) for c, v in enumerate(row) if v == 0]
        if empty:
            r, c = empty[self.rng.randint(len(empty))]
            self.board[r][c] = 2 if self.rng.uniform() < self.config.two_prob else 4

    def valid_moves(self) -> list[int]:
        return [d for d in range(4) if slide(self.board, d)[0] != self.board]

    def won(self) -> bool:
        return self.terminated and max(max(row) for row in self.board) >= 2048

    def step(self, action: int) -> tuple[float, bool, bool]:
        """Returns ``(reward, action_is_valid, action_is_effective)``."""
        if self.terminated or self.truncated or not 1 <= action <= 4:
            return 0.0, False, False
        self.num_steps += 1
        board, merged = slide(self.board, action - 1)
        moved = board != self.board
        if moved:
            self.board = board
            self.spawn()
            self.score += merged
            self.terminated = all(all(row) for row in self.board) and not self.valid_moves()
        raw = float(merged) if moved else -0.1
        if self.config.use_log_reward:
            reward = math.log2(raw + 1.0) * 0.1 if raw > 0 else 0.0
        else:
            reward = raw
        self.truncated = not self.terminated and self.num_steps >= self.config.max_steps
        return reward, moved, moved

    def render(self) -> str:
        lines = ["Current 2048 Grid:"]
        lines += [f"Row {i + 1}: [" + ", ".join(str(v) for v in row) + "]" for i, row in enumerate(self.board)]
        moves = self.valid_moves()
        lines += ["", "Valid Actions: " + (", ".join(ACTION_TEXT[d] for d in moves) if moves else "None") + ".",
                  "Goal: Merge same numbers to reach 2048.", f"Current Score: {self.score}", "What is your next move?"]
        return "\n".join(lines)

    def exponents(self) -> bytes:
        return bytes(v.bit_length() - 1 if v else 0 for row in self.board for v in row)


class PyGame2048Env(PyGridEnv):
    """Batch of pure-Python 2048 boards; same API, config and results as ``Game2048Env`` (C++).

    Config: see ``Game2048Config`` (``num_threads`` is accepted and ignored).
    """

    # This game's data (name, ids, rules, config): like the other twins' by shape only.
    name = "game_2048"
    action_names = GAME2048_ACTIONS
    instruction_text = GAME2048_INSTRUCTION
    config_cls = Game2048Config
    config: Game2048Config
    _state_fields = {
        "grid": (lambda g: np.array(g.board, dtype=np.int64), None),
        "score": (lambda g: g.score, np.int64),
        "spawn_draws": (lambda g: g.rng.counter, np.int64),
    }

    def _new_game(self, seed: int) -> Game2048:
        size = self.config.size
        return Game2048([[0] * size for _ in range(size)], seed, self.config, spawn_two=True)

    def reset_from_boards(self, tiles: Any, seeds: Sequence[int] | np.ndarray | None = None) -> list[str]:
        """Start every instance from a board (see ``game2048.check_boards``); ``seeds`` start the spawn streams."""
        tiles = check_boards(tiles, self.num_envs, self.config.size)
        seeds = check_seeds(np.zeros(self.num_envs, dtype=np.int64) if seeds is None else seeds, self.num_envs)
        self.games = [Game2048(tiles[i].tolist(), int(seeds[i]), self.config, spawn_two=False)
                      for i in range(self.num_envs)]
        return self.render()

    def _success(self, game: Game2048) -> bool:
        return game.won()

    def _state_key(self, game: Game2048) -> int:
        """FNV-1a 64 of the tile exponents then the score (int64 little-endian), as ``Game2048Env``."""
        return fnv1a64(game.score.to_bytes(8, "little", signed=True), fnv1a64(game.exponents()))
