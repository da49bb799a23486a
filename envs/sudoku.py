"""Sudoku on the C++ batch simulator (``fastpo._C.SudokuBatch``): RAGEN-2's ``sudoku`` env, a text-action env.

    env = SudokuEnv(8, difficulty="easy", render_format="with_feedback")      # RAGEN's SimpleSudoku tag
    obs = env.reset(np.arange(8))
    obs, reward, terminated, truncated, info = env.step(["place 5 at row 2 col 3"] * 8)

Actions are RAGEN's text: "place N at row R col C", "place N at (R,C)", "place N at R,C", "N at R,C",
"(R,C,N)" or "R,C,N" (1-based, case-insensitive; the first of these patterns found anywhere in the stripped,
lowercased text wins; when the text contains "place" or "at", the first number is N, else the last).
``parse_action`` is the rule. Every action costs a step. An action that does not parse, names a row, column or
number outside 1..G, targets a given cell, or repeats a number of its row, column or box is refused:
reward ``invalid_action_score`` (-0.1), ``action_is_valid`` False, and the observation's feedback line says why,
in RAGEN's words. A placement pays ``correct_placement_score`` (1.0) when it matches the generated solution,
half of it otherwise; filling the grid pays ``completion_bonus`` (10) more and ends the episode (``success``).
``truncated`` when a placement uses the last of ``max_steps`` steps (RAGEN checks the budget only there).

Puzzles: RAGEN's generator (fill the grid cell by cell in row-major order, each cell trying 1..G in a shuffled
order with backtracking, then blank the first ``cells_to_remove`` cells of a shuffled cell list), with the
shuffles drawn from ``CounterRng(seed, STREAM_SUDOKU)`` (a shuffle of n items: for k = n-1 .. 1, swap k with
``randint(k + 1)``). Because every placement is checked, a grid never holds a conflict, so RAGEN's conflict
markers (*N* and "CONFLICTS DETECTED") never appear in its renders, nor here.

Results equal the pure-Python twin ``PySudokuEnv`` (``envs/py_sudoku.py``) exactly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import BatchEnv, StepResult, build_config, check_mask, check_seeds, check_text_actions
from .layouts import _check_int
from .prompt_text import SUDOKU_INSTRUCTION

#: RAGEN's blanks per difficulty, as a fraction of the cells (int() of G * G * fraction).
DIFFICULTY_BLANKS = {"easy": 0.4, "medium": 0.5, "hard": 0.6}
RENDER_FORMATS = {"simple": 0, "detailed": 1, "with_feedback": 2}
#: Placement attempts of the generator's fill before giving up (csrc/sudoku.h kSudokuMaxFillSteps).
MAX_FILL_STEPS = 2_000_000

_PATTERNS = [re.compile(p) for p in (
    r"place\s+(\d+)\s+at\s+row\s+(\d+)\s+col\s+(\d+)",
    r"place\s+(\d+)\s+at\s+\((\d+),\s*(\d+)\)",
    r"place\s+(\d+)\s+at\s+(\d+),\s*(\d+)",
    r"(\d+)\s+at\s+(\d+),\s*(\d+)",
    r"\((\d+),\s*(\d+),\s*(\d+)\)",
    r"(\d+),\s*(\d+),\s*(\d+)",
)]


def parse_action(text: str, grid_size: int) -> tuple[int, int, int, int, str]:
    """RAGEN's parse_action: ``(1, row, col, num, "")`` with 0-based row and col for a placement in range, or
    ``(2, 0, 0, 0, message)`` with RAGEN's error message. The C++ env parses ASCII text itself, identically."""
    action = text.strip().lower()
    for pattern in _PATTERNS:
        match = pattern.search(action)
        if match is None:
            continue
        a, b, c = (int(x) for x in match.groups())
        num, row, col = (a, b, c) if ("place" in action or "at" in action) else (c, a, b)
        for label, value in (("Row", row), ("Column", col), ("Number", num)):
            if not 1 <= value <= grid_size:
                return 2, 0, 0, 0, f"{label} {value} is out of range (1-{grid_size})"
        return 1, row - 1, col - 1, num, ""
    return 2, 0, 0, 0, f"Could not parse action: '{action}'. Expected format: 'place 5 at row 2 col 3' or '2,3,5'"


@dataclasses.dataclass
class SudokuConfig:
    """Sudoku env config (RAGEN-2's SudokuEnvConfig)."""

    grid_size: int = 9
    """4 or 9. (RAGEN also lists 16; its backtracking fill of an empty 16x16 grid can run for hours, so fastpo
    refuses it.)"""
    difficulty: str = "easy"
    """"easy", "medium" or "hard": 40%, 50% or 60% of the cells blank."""
    max_steps: int = 81
    """Step budget: a placement that uses the last step ends the episode (truncated)."""
    render_format: str = "detailed"
    """"simple" (the bare grid), "detailed" (grid, legend, last feedback) or "with_feedback" (also the valid
    numbers of the empty cells when at most 10 are left, progress and steps; RAGEN's Sudoku tags use it)."""
    show_conflicts: bool = True
    """RAGEN's flag for the conflict list of "with_feedback"; a grid never has conflicts (see the module text)."""
    show_valid_numbers: bool = True
    """List the valid numbers of the empty cells ("with_feedback", at most 10 empty cells)."""
    correct_placement_score: float = 1.0
    """Reward of a placement matching the solution (half of it for another allowed number)."""
    invalid_action_score: float = -0.1
    """Reward of a refused action."""
    completion_bonus: float = 10.0
    """Added when the grid is full."""
    num_threads: int = 1
    """Worker threads of the C++ batch (1 = run in the calling thread); the Python twin ignores it."""

    def __post_init__(self):
        if isinstance(self.grid_size, bool) or self.grid_size not in (4, 9):
            raise ValueError(f"grid_size must be 4 or 9, got {self.grid_size!r}")
        for name, choices in (("difficulty", DIFFICULTY_BLANKS), ("render_format", RENDER_FORMATS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
        _check_int("max_steps", self.max_steps, 1, 2**31 - 1)
        _check_int("num_threads", self.num_threads, 1, 256)
        for name in ("show_conflicts", "show_valid_numbers"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("correct_placement_score", "invalid_action_score", "completion_bonus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))

    @property
    def cells_to_remove(self) -> int:
        return int(self.grid_size * self.grid_size * DIFFICULTY_BLANKS[self.difficulty])


def check_puzzles(initial: Any, solution: Any, num_envs: int, grid_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Puzzles for ``reset_from_puzzles``: ``initial`` and ``solution`` as ``uint8[num_envs, G, G]``; each solution a
    complete valid grid, each puzzle 0 or the solution's number per cell. Raises ValueError naming env, row, column."""
    out = []
    for name, value in (("initial", initial), ("solution", solution)):
        arr = np.asarray(value)
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must be integers ({num_envs} x {grid_size} x {grid_size}), got {arr.dtype}")
        if arr.shape != (num_envs, grid_size, grid_size):
            raise ValueError(f"{name} must have shape ({num_envs}, {grid_size}, {grid_size}), got {arr.shape}")
        out.append(arr)
    initial, solution = out
    box = 2 if grid_size == 4 else 3
    want = set(range(1, grid_size + 1))
    for i in range(num_envs):
        sol = solution[i]
        groups = [(f"row {r + 1}", sol[r, :]) for r in range(grid_size)]
        groups += [(f"column {c + 1}", sol[:, c]) for c in range(grid_size)]
        groups += [(f"box ({br + 1},{bc + 1})", sol[br * box:(br + 1) * box, bc * box:(bc + 1) * box].ravel())
                   for br in range(box) for bc in range(box)]
        for where, cells in groups:
            if set(cells.tolist()) != want:
                raise ValueError(f"solution of env {i}: {where} is {cells.tolist()}, not the numbers 1..{grid_size}")
        wrong = np.argwhere((initial[i] != 0) & (initial[i] != sol))
        if len(wrong):
            r, c = (int(x) for x in wrong[0])
            raise ValueError(f"puzzle of env {i}: row {r + 1}, column {c + 1} holds {initial[i, r, c]}, "
                             f"but the solution has {sol[r, c]} (cells are 0 or the solution's number)")
    return np.ascontiguousarray(initial, dtype=np.uint8), np.ascontiguousarray(solution, dtype=np.uint8)


class SudokuBase(BatchEnv):
    """What the C++ env and its pure-Python twin (``py_sudoku.PySudokuEnv``) share: the name, the text action space
    and the config, read once."""

    name = "sudoku"
    action_space = "text"
    action_names: list[str] = []
    max_actions_per_turn = 5

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs)
        self.config: SudokuConfig = build_config(SudokuConfig, self.name, config)


class SudokuEnv(SudokuBase):
    """``num_envs`` Sudoku puzzles; text actions (see the module docstring). Config: see ``SudokuConfig``.

    ``step(actions, active=None, render=True)``: ``actions`` a list of ``num_envs`` str; instances with ``active``
    False are not stepped. State key: FNV-1a 64 of the puzzle then the current grid (G * G bytes each; not the
    feedback text or the step counter). ``get_state``: initial/current/solution ``uint8[N, G, G]``, num_steps
    ``int32[N]``, terminated/truncated ``bool[N]``.
    """

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        from fastpo import _C

        cfg = self.config
        self._batch = _C.SudokuBatch(
            self.num_envs, cfg.grid_size, cfg.cells_to_remove, cfg.max_steps, RENDER_FORMATS[cfg.render_format],
            cfg.show_conflicts, cfg.show_valid_numbers, cfg.correct_placement_score, cfg.invalid_action_score,
            cfg.completion_bonus, cfg.num_threads,
        )
        size = cfg.grid_size
        self._parse = lambda text: parse_action(text, size)

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        return self._batch.reset(check_seeds(seeds, self.num_envs), check_mask(mask, self.num_envs))

    def reset_from_puzzles(self, initial: Any, solution: Any) -> list[str]:
        """Start every instance from a given puzzle and its solution (see ``check_puzzles``)."""
        initial, solution = check_puzzles(initial, solution, self.num_envs, self.config.grid_size)
        return self._batch.set_puzzles(initial, solution)

    def step(self, actions: Sequence[str], active: np.ndarray | None = None, render: bool = True) -> StepResult:
        """One text action per instance -> ``(obs or None, reward float32[N], terminated, truncated, info)``."""
        actions = check_text_actions(actions, self.num_envs, check_items=False)  # items: in C++
        active = None if active is None else check_mask(active, self.num_envs)
        obs, reward, terminated, truncated, success, valid, effective = self._batch.step(
            actions, active, render, self._parse)
        return obs, reward, terminated, truncated, {"success": success, "action_is_valid": valid,
                                                    "action_is_effective": effective}

    def render(self) -> list[str]:
        return self._batch.render()

    def instruction(self) -> str:
        """RAGEN's env_instruction of its Sudoku tags (no legend, no action list)."""
        return SUDOKU_INSTRUCTION

    def state_keys(self) -> np.ndarray:
        return self._batch.state_keys()

    def get_state(self) -> dict[str, np.ndarray]:
        return self._batch.get_state()
