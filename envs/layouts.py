"""What the C++ envs and their pure-Python twins share: configs, symbols, instructions, layout parsing.

The instructions, legends and action names are also RAGEN's prompt text: ``fastpo.prompts`` imports them from here.

Sokoban cell codes (gym-sokoban's): 0 wall, 1 empty, 2 target, 3 box on target, 4 box, 5 player,
6 player on target (render only). FrozenLake maps are stored as ASCII codes of ``S F H G``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------------------------- Sokoban

#: Render symbols for codes 0..6, per symbol set (RAGEN's grid_lookup / SokobanDifferentGridVocab).
SOKOBAN_SYMBOLS = {"default": "#_O√XPS", "different": "W.GCBA@"}
SOKOBAN_SYMBOL_NAMES = ("wall", "empty", "target", "box on target", "box", "player", "player on target")
SOKOBAN_ACTIONS = ["Up", "Down", "Left", "Right"]
SOKOBAN_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. You cannot push a box "
    "through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
    "<answer>Right || Right || Up</answer>"
)
#: Hard limits of the generator (the C++ key and the Python twin's recursion stay bounded).
SOKOBAN_MAX_DIM = 64
SOKOBAN_MAX_SEARCH_DEPTH = 1000
#: Retries of a failed generation (RAGEN retries forever with a new hashed seed).
SOKOBAN_MAX_ATTEMPTS = 1000


@dataclasses.dataclass
class SokobanConfig:
    """Sokoban env config (RAGEN's SokobanEnvConfig + gym-sokoban's generator knobs)."""

    dim_room: tuple[int, int] = (6, 6)
    """(rows, cols) including the border walls; each in [4, 64]."""
    num_boxes: int = 1
    """Boxes (= targets) per level; at least 1 and fewer than interior cells - 1."""
    search_depth: int = 300
    """Time-to-live of the reverse-play DFS (RAGEN: 300 SimpleSokoban, 10 LargerSokoban); [2, 1000]."""
    max_steps: int = 10
    """Per-episode action budget: the episode is truncated after this many valid actions."""
    symbols: str = "default"
    """Render symbol set: "default" (# _ O √ X P S) or "different" (W . G C B A @)."""
    num_threads: int = 1
    """Worker threads of the C++ batch (1 = run in the calling thread); the Python twin ignores it."""
    p_change_directions: float = 0.35
    """Probability of redrawing the direction at each random-walk step of the topology; [0, 1]."""
    num_gen_steps: int | None = None
    """Random-walk steps of the topology; None means int(1.7 * (rows + cols)) as in gym-sokoban."""
    observation_format: str = "grid"
    """RAGEN's observation_format: "grid" (symbols), "coord" (coordinate lists) or "grid_coord" (both;
    RAGEN-2's CoordSokoban)."""

    def __post_init__(self):
        dim = self.dim_room
        if (
            not isinstance(dim, (tuple, list))
            or len(dim) != 2
            or not all(_is_int(d) and 4 <= d <= SOKOBAN_MAX_DIM for d in dim)
        ):
            raise ValueError(f"dim_room must be (rows, cols) with each in [4, {SOKOBAN_MAX_DIM}], got {dim!r}")
        self.dim_room = (int(dim[0]), int(dim[1]))
        max_boxes = (self.dim_room[0] - 2) * (self.dim_room[1] - 2) - 2
        _check_int("num_boxes", self.num_boxes, 1, max_boxes)
        _check_int("search_depth", self.search_depth, 2, SOKOBAN_MAX_SEARCH_DEPTH)
        _check_int("max_steps", self.max_steps, 1, 2**31 - 1)
        _check_int("num_threads", self.num_threads, 1, 256)
        if self.symbols not in SOKOBAN_SYMBOLS:
            raise ValueError(f"symbols must be one of {sorted(SOKOBAN_SYMBOLS)}, got {self.symbols!r}")
        _check_float("p_change_directions", self.p_change_directions, 0.0, 1.0)
        if self.num_gen_steps is not None:
            _check_int("num_gen_steps", self.num_gen_steps, 1, 100_000)
        _check_choice("observation_format", self.observation_format, OBSERVATION_FORMATS)

    @property
    def gen_steps(self) -> int:
        """Random-walk steps actually used by the generator."""
        if self.num_gen_steps is not None:
            return int(self.num_gen_steps)
        return int(1.7 * (self.dim_room[0] + self.dim_room[1]))


def sokoban_grid_vocab(symbols: str) -> dict[str, str]:
    """Symbol -> meaning, in code order (RAGEN's grid_vocab)."""
    return dict(zip(SOKOBAN_SYMBOLS[symbols], SOKOBAN_SYMBOL_NAMES, strict=True))


# Layout character -> (room_fixed code, room_state code), default symbol set.
_SOKOBAN_LAYOUT_CODES = {"#": (0, 0), "_": (1, 1), "O": (2, 2), "√": (2, 3), "X": (1, 4), "P": (1, 5), "S": (2, 5)}


def parse_sokoban_layouts(layouts: Any, num_envs: int, dim_room: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Parse ``num_envs`` Sokoban text grids in the default symbols (``# _ O √ X P S``).

    Each layout is a string with rows joined by ``"\\n"`` (leading/trailing newlines ignored) or a list of
    row strings. Returns ``(room_fixed, room_state)``, both ``uint8[num_envs, rows, cols]``.
    Raises ValueError naming the env index, row and column of the first problem.
    """
    rows_cols = tuple(dim_room)
    grids = _layout_rows(layouts, num_envs, rows_cols, set(_SOKOBAN_LAYOUT_CODES), "# _ O √ X P S")
    fixed = np.zeros((num_envs, *rows_cols), dtype=np.uint8)
    state = np.zeros((num_envs, *rows_cols), dtype=np.uint8)
    for i, grid in enumerate(grids):
        players, boxes, targets = [], 0, 0
        for r, row in enumerate(grid):
            for c, ch in enumerate(row):
                fixed[i, r, c], state[i, r, c] = _SOKOBAN_LAYOUT_CODES[ch]
                players += [(r, c)] if ch in "PS" else []
                boxes += ch in "X√"
                targets += ch in "O√S"
        if len(players) != 1:
            where = "" if not players else f" (at row {players[1][0]}, column {players[1][1]})"
            raise ValueError(f"layout of env {i}: expected exactly one player (P or S), found {len(players)}{where}")
        if boxes != targets or boxes == 0:
            raise ValueError(
                f"layout of env {i}: boxes (X, √) and targets (O, √, S) must be equal and >= 1, "
                f"found {boxes} boxes and {targets} targets"
            )
    return fixed, state


# --------------------------------------------------------------------------------------------- FrozenLake

FROZENLAKE_ACTIONS = ["Left", "Down", "Right", "Up"]
# "Forbid the whole" is RAGEN's wording; kept verbatim.
FROZENLAKE_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to the "
    "unintended direction due to the slippery ice. Example answer format: <think>To forbid the hole and go to "
    "the target, I should go left then go up.</think><answer>Left || Up</answer>"
)
#: Render symbols: player, frozen (start renders as frozen), hole, goal, player in hole, player on goal.
FROZENLAKE_GRID_VOCAB = {
    "P": "player",
    "_": "empty",
    "O": "hole",
    "G": "goal",
    "X": "player in hole",
    "√": "player on goal",
}
FROZENLAKE_MAX_SIZE = 64
#: Map draws before giving up (only reachable with tiny p on big maps).
FROZENLAKE_MAX_MAP_TRIES = 1_000_000


@dataclasses.dataclass
class FrozenLakeConfig:
    """FrozenLake env config (RAGEN's FrozenLakeEnvConfig)."""

    size: int = 4
    """Side of the square map; [2, 64]."""
    p: float = 0.8
    """Probability that a cell is frozen (else a hole); (0, 1]."""
    is_slippery: bool = True
    """Slippery ice: the move may go to a perpendicular direction (see ``success_rate``)."""
    success_rate: float | None = None
    """On slippery ice, the probability in [0, 1] of the intended move; each perpendicular direction gets
    (1 - success_rate) / 2 (RAGEN-2's rule; its FrozenLake tag uses 0.8). None: gym's slip, the intended and each
    perpendicular direction w.p. 1/3."""
    observation_format: str = "grid"
    """RAGEN's observation_format: "grid" (symbols), "coord" (coordinate lists) or "grid_coord" (both;
    RAGEN-2's CoordFrozenLake)."""
    max_steps: int = 10
    """Per-episode action budget: the episode is truncated after this many valid actions."""
    num_threads: int = 1
    """Worker threads of the C++ batch (1 = run in the calling thread); the Python twin ignores it."""

    def __post_init__(self):
        _check_int("size", self.size, 2, FROZENLAKE_MAX_SIZE)
        _check_float("p", self.p, 0.0, 1.0)
        if self.p <= 0.0:
            raise ValueError(f"p must be in (0, 1], got {self.p!r}")
        if not isinstance(self.is_slippery, (bool, np.bool_)):
            raise ValueError(f"is_slippery must be a bool, got {self.is_slippery!r}")
        self.is_slippery = bool(self.is_slippery)
        if self.success_rate is not None:
            _check_float("success_rate", self.success_rate, 0.0, 1.0)
            self.success_rate = float(self.success_rate)
        _check_int("max_steps", self.max_steps, 1, 2**31 - 1)
        _check_int("num_threads", self.num_threads, 1, 256)
        _check_choice("observation_format", self.observation_format, OBSERVATION_FORMATS)


def parse_frozenlake_layouts(layouts: Any, num_envs: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse ``num_envs`` FrozenLake maps (gymnasium style ``S F H G``).

    Each layout is a list of row strings or one newline-joined string. Returns ``(desc, start)``:
    ``uint8[num_envs, size, size]`` ASCII codes and ``int32[num_envs]`` start cells (``row * size + col``).
    Raises ValueError naming the env index, row and column of the first problem.
    """
    grids = _layout_rows(layouts, num_envs, (size, size), set("SFHG"), "S F H G")
    desc = np.zeros((num_envs, size, size), dtype=np.uint8)
    start = np.zeros(num_envs, dtype=np.int32)
    for i, grid in enumerate(grids):
        desc[i] = np.frombuffer("".join(grid).encode("ascii"), dtype=np.uint8).reshape(size, size)
        for ch in "SG":
            cells = [(r, c) for r, row in enumerate(grid) for c, x in enumerate(row) if x == ch]
            if len(cells) != 1:
                where = "" if len(cells) < 2 else f" (second at row {cells[1][0]}, column {cells[1][1]})"
                raise ValueError(f"layout of env {i}: expected exactly one {ch!r}, found {len(cells)}{where}")
            if ch == "S":
                start[i] = cells[0][0] * size + cells[0][1]
    return desc, start


# ------------------------------------------------------------------------------------ coordinate formats

#: RAGEN's observation formats -> the C++ batch's code (csrc/coords.h ObsFormat).
OBSERVATION_FORMATS = {"grid": 0, "coord": 1, "grid_coord": 2}


def _coord_lines(rows: int, cols: int, labelled: Sequence[tuple[str, Sequence[int]]]) -> str:
    """RAGEN's format_coordinate_render: the board size, then one line per non-empty list of row-major cells."""
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for label, cells in labelled:
        if cells:
            lines.append(f"{label}: " + ", ".join(f"({c // cols}, {c % cols})" for c in cells))
    return "\n".join(lines)


def sokoban_coord_text(room_fixed: np.ndarray, room_state: np.ndarray) -> str:
    """RAGEN-2's Sokoban coordinate text from gym-sokoban codes (``uint8[R, C]`` each); walls are left out."""
    rows, cols = room_fixed.shape
    fixed, state = room_fixed.ravel().tolist(), room_state.ravel().tolist()
    cells = range(rows * cols)
    return _coord_lines(rows, cols, [
        ("Targets", [c for c in cells if fixed[c] == 2]),
        ("Boxes", [c for c in cells if state[c] == 4]),
        ("Boxes on target", [c for c in cells if state[c] == 3]),
        ("Player", [c for c in cells if state[c] == 5 and fixed[c] != 2]),
        ("Player on target", [c for c in cells if state[c] == 5 and fixed[c] == 2]),
    ])


def frozenlake_coord_text(desc: np.ndarray, position: int) -> str:
    """RAGEN-2's FrozenLake coordinate text from the map (``uint8[S, S]`` ASCII) and the player cell."""
    size = desc.shape[0]
    letters = bytes(desc.ravel().tolist()).decode("ascii")
    tile = letters[position]
    return _coord_lines(size, size, [
        ("Start", [c for c, x in enumerate(letters) if x == "S"]),
        ("Goal", [c for c, x in enumerate(letters) if x == "G"]),
        ("Player", [position] if tile not in "GH" else []),
        ("Player on goal", [position] if tile == "G" else []),
        ("Player in hole", [position] if tile == "H" else []),
        ("Holes", [c for c, x in enumerate(letters) if x == "H"]),
    ])


def format_observation(observation_format: str, grid: str, coords: str) -> str:
    """The observation in ``observation_format`` from its two halves (RAGEN's ``_render_text``)."""
    if observation_format == "grid":
        return grid
    if observation_format == "coord":
        return coords
    return "Coordinates: \n" + coords + "\nGrid Map: \n" + grid


# ---------------------------------------------------------------------------------------------- helpers


def _layout_rows(
    layouts: Any, num_envs: int, shape: tuple[int, int], alphabet: set[str], alphabet_text: str
) -> list[list[str]]:
    """Split and check layouts: ``num_envs`` grids of ``shape`` over ``alphabet``."""
    if isinstance(layouts, (str, bytes)) or not isinstance(layouts, Sequence):
        raise ValueError(f"layouts must be a list of {num_envs} layouts, got {type(layouts).__name__}")
    if len(layouts) != num_envs:
        raise ValueError(f"layouts must have length {num_envs}, got {len(layouts)}")
    rows_expected, cols_expected = shape
    grids = []
    for i, layout in enumerate(layouts):
        if isinstance(layout, str):
            rows = layout.strip("\n").split("\n")
        elif isinstance(layout, Sequence) and all(isinstance(r, str) for r in layout):
            rows = list(layout)
        else:
            raise ValueError(f"layout of env {i} must be a string or a list of row strings, got {layout!r}")
        if not rows:
            raise ValueError(f"layout of env {i}: empty layout, expected {rows_expected} rows")
        for r, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise ValueError(
                    f"layout of env {i}: ragged rows, row {r} ends at column {len(row)} but row 0 at column "
                    f"{len(rows[0])}"
                )
            for c, ch in enumerate(row):
                if ch not in alphabet:
                    raise ValueError(
                        f"layout of env {i}: unknown symbol {ch!r} at row {r}, column {c}; accepted: {alphabet_text}"
                    )
        if (len(rows), len(rows[0])) != (rows_expected, cols_expected):
            raise ValueError(
                f"layout of env {i}: size {len(rows)}x{len(rows[0])} (rows x columns) does not match the env's "
                f"{rows_expected}x{cols_expected}"
            )
        grids.append(rows)
    return grids


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


def _check_choice(name: str, value: Any, choices: Any) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    if not lo <= float(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
