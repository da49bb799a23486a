"""Pure-Python Sudoku: the test oracle and the speed baseline of the C++ env (``fastpo.envs.sudoku``, whose
docstring states the rules). A grid is a list of rows of ints (0 = empty)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import StepResult, check_mask, check_seeds, check_text_actions, empty_info, fnv1a64
from .prompt_text import SUDOKU_INSTRUCTION
from .rng import STREAM_SUDOKU, CounterRng
from .sudoku import MAX_FILL_STEPS, SudokuBase, SudokuConfig, check_puzzles, parse_action


def shuffle(items: list, rng: CounterRng) -> None:
    """Python's random.shuffle with ``rng.randint`` as its randbelow."""
    for k in range(len(items) - 1, 0, -1):
        j = rng.randint(k + 1)
        items[k], items[j] = items[j], items[k]


def box_of(size: int) -> int:
    return 2 if size == 4 else 3


def used_numbers(grid: list[list[int]], row: int, col: int) -> set[int]:
    """The numbers in the row, column and box of (row, col), the cell itself included."""
    box = box_of(len(grid))
    r0, c0 = row // box * box, col // box * box
    used = set(grid[row]) | {grid[r][col] for r in range(len(grid))}
    used |= {grid[r][c] for r in range(r0, r0 + box) for c in range(c0, c0 + box)}
    return used - {0}


def generate_puzzle(seed: int, size: int, cells_to_remove: int) -> tuple[list[list[int]], list[list[int]]]:
    """RAGEN's generate_sudoku_puzzle with ``CounterRng(seed, STREAM_SUDOKU)``: (puzzle, solution)."""
    rng = CounterRng(seed, STREAM_SUDOKU)
    grid = [[0] * size for _ in range(size)]
    steps = 0

    def fill(cell: int) -> bool:  # the first empty cell is `cell`: cells fill in row-major order
        nonlocal steps
        if cell == size * size:
            return True
        row, col = divmod(cell, size)
        numbers = list(range(1, size + 1))
        shuffle(numbers, rng)
        # the same for every candidate: a failed deeper fill leaves the later cells empty again
        used = used_numbers(grid, row, col)
        for num in numbers:
            steps += 1
            if steps > MAX_FILL_STEPS:
                raise RuntimeError(f"Sudoku fill for seed {seed} took more than {MAX_FILL_STEPS} placements")
            if num not in used:
                grid[row][col] = num
                if fill(cell + 1):
                    return True
                grid[row][col] = 0
        return False

    fill(0)
    cells = list(range(size * size))
    shuffle(cells, rng)
    puzzle = [row[:] for row in grid]
    for c in cells[:cells_to_remove]:
        puzzle[c // size][c % size] = 0
    return puzzle, grid


class SudokuGame:
    """One puzzle and its episode state."""

    def __init__(self, initial: list[list[int]], solution: list[list[int]], config: SudokuConfig):
        self.initial, self.solution, self.config = initial, solution, config
        self.grid = [row[:] for row in initial]
        self.size = len(initial)
        self.num_steps = 0
        self.feedback = ""
        self.terminated = self.truncated = self.solved = False

    def step(self, text: str) -> tuple[float, bool]:
        """Returns ``(reward, placed)``; the caller skips finished games."""
        cfg = self.config
        self.num_steps += 1
        kind, row, col, num, error = parse_action(text, self.size)
        at = f"({row + 1},{col + 1})"
        if kind == 2:
            self.feedback = f"\u274c Invalid action format: {error}"
            return cfg.invalid_action_score, False
        if self.initial[row][col] != 0:
            self.feedback = f"\u274c Cannot modify initial cell at {at}"
            return cfg.invalid_action_score, False
        if num in used_numbers(self.grid, row, col):
            box = box_of(self.size)
            r0, c0 = row // box * box, col // box * box
            where = []
            if num in self.grid[row]:
                where.append(f"row {row + 1}")
            if num in [self.grid[r][col] for r in range(self.size)]:
                where.append(f"column {col + 1}")
            if num in [self.grid[r][c] for r in range(r0, r0 + box) for c in range(c0, c0 + box)]:
                where.append(f"box ({r0 // box + 1},{c0 // box + 1})")
            self.feedback = f"\u274c Invalid placement: {num} conflicts with {', '.join(where)}"
            valid = self.valid_numbers(row, col)
            if valid:
                self.feedback += f"\n   Valid numbers for {at}: {valid}"
            return cfg.invalid_action_score, False
        self.grid[row][col] = num
        if num == self.solution[row][col]:
            self.feedback = f"\u2713 Correct! Placed {num} at {at}"
            reward = cfg.correct_placement_score
        else:
            self.feedback = f"\u26a0 Placed {num} at {at} - Valid but not optimal"
            reward = cfg.correct_placement_score * 0.5
        self.solved = all(all(row) for row in self.grid)
        if self.solved:
            self.feedback += "\n\U0001f389 Congratulations! Puzzle solved!"
            reward += cfg.completion_bonus
        self.terminated = self.solved
        self.truncated = not self.solved and self.num_steps >= cfg.max_steps
        return reward, True

    def valid_numbers(self, row: int, col: int) -> list[int]:
        if self.grid[row][col] != 0:
            return []
        used = used_numbers(self.grid, row, col)
        return [v for v in range(1, self.size + 1) if v not in used]

    def grid_text(self, detailed: bool) -> str:
        """RAGEN's format_grid_simple (cells "N " or ". ") or, ``detailed``, format_grid_with_conflicts (cells " . ",
        "[N]" given, " N " placed; a grid here never has conflicts): "| " between boxes, dashes between bands."""
        size, box = self.size, box_of(self.size)
        width = 3 if detailed else 2
        lines = []
        for r, row in enumerate(self.grid):
            if r > 0 and r % box == 0:
                lines.append("-" * (size * width + box - 1))
            text = ""
            for c, v in enumerate(row):
                text += "| " if c > 0 and c % box == 0 else ""
                if detailed:
                    text += " . " if v == 0 else f"[{v}]" if self.initial[r][c] else f" {v} "
                else:
                    text += (str(v) if v else ".") + " "
            lines.append(text.rstrip())
        return "\n".join(lines)

    def render(self) -> str:
        size, cfg = self.size, self.config
        if cfg.render_format == "simple":
            return self.grid_text(detailed=False)
        out = ["=" * 50, "SUDOKU PUZZLE", "=" * 50, self.grid_text(detailed=True), "",
               "Legend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty"]
        if self.feedback:
            out += ["", self.feedback]
        if cfg.render_format == "detailed":
            return "\n".join(out)
        empty = [(r, c) for r in range(size) for c in range(size) if self.grid[r][c] == 0]
        if cfg.show_valid_numbers and 0 < len(empty) <= 10:
            out += ["", "\U0001f4a1 VALID NUMBERS FOR EMPTY CELLS:"]
            for r, c in empty:
                valid = self.valid_numbers(r, c)
                if valid:
                    out.append(f"  - ({r + 1},{c + 1}): {valid}")
        filled = sum(1 for row in self.grid for v in row if v)
        given = sum(1 for row in self.initial for v in row if v)
        out += ["", f"Progress: {filled}/{size * size} cells filled ({given} initial, {filled - given} placed)",
                f"Steps: {self.num_steps}/{cfg.max_steps}"]
        return "\n".join(out)


class PySudokuEnv(SudokuBase):
    """Batch of pure-Python Sudoku puzzles; same API, config and results as ``SudokuEnv`` (C++)."""

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        self.games: list[SudokuGame | None] = [None] * self.num_envs

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        seeds = check_seeds(seeds, self.num_envs)
        cfg = self.config
        for i in np.flatnonzero(check_mask(mask, self.num_envs)):
            self.games[i] = SudokuGame(*generate_puzzle(int(seeds[i]), cfg.grid_size, cfg.cells_to_remove), cfg)
        return self.render()

    def reset_from_puzzles(self, initial: Any, solution: Any) -> list[str]:
        initial, solution = check_puzzles(initial, solution, self.num_envs, self.config.grid_size)
        self.games = [SudokuGame(initial[i].tolist(), solution[i].tolist(), self.config) for i in range(self.num_envs)]
        return self.render()

    def step(self, actions: Sequence[str], active: np.ndarray | None = None, render: bool = True) -> StepResult:
        actions = check_text_actions(actions, self.num_envs)
        active = None if active is None else check_mask(active, self.num_envs)
        games = self._games()
        n = self.num_envs
        reward = np.zeros(n, dtype=np.float32)
        info = empty_info(n)
        for i, game in enumerate(games):
            if (active is None or active[i]) and not (game.terminated or game.truncated):
                reward[i], placed = game.step(actions[i])
                info["action_is_valid"][i] = info["action_is_effective"][i] = placed
            info["success"][i] = game.solved
        terminated = np.array([g.terminated for g in games], dtype=bool)
        truncated = np.array([g.truncated for g in games], dtype=bool)
        return (self.render() if render else None), reward, terminated, truncated, info

    def render(self) -> list[str]:
        return [g.render() for g in self._games()]

    def instruction(self) -> str:
        return SUDOKU_INSTRUCTION

    def state_keys(self) -> np.ndarray:
        """FNV-1a 64 of the puzzle then the current grid, as ``SudokuEnv``."""
        return np.array([fnv1a64(bytes(v for row in g.grid for v in row), fnv1a64(bytes(v for row in g.initial
                         for v in row))) for g in self._games()], dtype=np.uint64)

    def get_state(self) -> dict[str, np.ndarray]:
        games = self._games()
        return {
            "initial": np.array([g.initial for g in games], dtype=np.uint8),
            "current": np.array([g.grid for g in games], dtype=np.uint8),
            "solution": np.array([g.solution for g in games], dtype=np.uint8),
            "num_steps": np.array([g.num_steps for g in games], dtype=np.int32),
            "terminated": np.array([g.terminated for g in games], dtype=bool),
            "truncated": np.array([g.truncated for g in games], dtype=bool),
        }

    def _games(self) -> list[SudokuGame]:
        missing = [i for i, g in enumerate(self.games) if g is None]
        if missing:
            raise RuntimeError(f"instances {missing[:8]} were never reset; call reset() or reset_from_puzzles() first")
        return self.games
