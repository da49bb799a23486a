"""Pure-Python 2x2 Rubik's cube: the test oracle and the speed baseline of the C++ env (``fastpo.envs.rubiks``,
whose docstring states the rules)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import fnv1a64
from .grid import PyGridEnv
from .prompt_text import RUBIKS_ACTIONS, RUBIKS_INSTRUCTION
from .rng import STREAM_RUBIKS, CounterRng
from .rubiks import TURNS, RubiksConfig, check_cubes

COLOURS = "WOGRBY"
FACES = ("Up (U):    ", "Left (L):  ", "Front (F): ", "Right (R): ", "Back (B):  ", "Down (D):  ")


class Cube:
    def __init__(self, stickers: list[int], max_steps: int):
        self.stickers = stickers
        self.max_steps = max_steps
        self.num_steps = 0
        self.terminated = self.truncated = False

    def turn(self, action: int) -> None:
        perm = TURNS[(action - 1) // 2]
        for _ in range(3 if action % 2 == 0 else 1):
            self.stickers = [self.stickers[p] for p in perm]

    def solved(self) -> bool:
        return all(len(set(self.stickers[f * 4:f * 4 + 4])) == 1 for f in range(6))

    def step(self, action: int) -> tuple[float, bool, bool]:
        if self.terminated or self.truncated or not 1 <= action <= 12:
            return 0.0, False, False
        self.turn(action)
        self.num_steps += 1
        self.terminated = self.solved()
        self.truncated = not self.terminated and self.num_steps >= self.max_steps
        return (1.0 if self.terminated else 0.0), True, True

    def render(self) -> str:
        lines = ["=== Rubik's Cube 2x2 State ===", f"Step: {self.num_steps}/{self.max_steps}", ""]
        for f, label in enumerate(FACES):
            c = [COLOURS[x] for x in self.stickers[f * 4:f * 4 + 4]]
            lines.append(f"{label}[{c[0]}, {c[1]}]\n [{c[2]}, {c[3]}]")
        lines += ["", "Available Actions:", "U, U', D, D', L, L', R, R', F, F', B, B'", "\nWhat is your next move?"]
        return "\n".join(lines)


class PyRubiksEnv(PyGridEnv):
    """Batch of pure-Python 2x2 cubes; same API, config and results as ``RubiksEnv`` (C++)."""

    name = "rubikscube"
    action_names = RUBIKS_ACTIONS
    instruction_text = RUBIKS_INSTRUCTION
    config_cls = RubiksConfig
    config: RubiksConfig
    _state_fields = {"stickers": (lambda g: np.array(g.stickers, dtype=np.uint8), None)}

    def _new_game(self, seed: int) -> Cube:
        cube = Cube([k // 4 for k in range(24)], self.config.max_steps)
        rng = CounterRng(seed, STREAM_RUBIKS)
        for _ in range(self.config.scramble_depth):
            cube.turn(rng.randint(12) + 1)
        return cube

    def reset_from_cubes(self, stickers: Any) -> list[str]:
        arr = check_cubes(stickers, self.num_envs)
        self.games = [Cube(arr[i].tolist(), self.config.max_steps) for i in range(self.num_envs)]
        return self.render()

    def _success(self, game: Cube) -> bool:
        return game.terminated

    def _state_key(self, game: Cube) -> int:
        return fnv1a64(bytes(game.stickers))
