"""Pure-Python Sokoban: the test oracle and the speed baseline of the C++ env (``fastpo.envs.sokoban``).

Level generation is RAGEN's ``generate_room`` (gym-sokoban's algorithm plus RAGEN's random player
displacement) and stepping is gym-sokoban's ``_push`` / ``_move`` / ``_calc_reward``, written per instance
and step for step, with every random draw taken from ``CounterRng(seed, STREAM_SOKOBAN_GEN, attempt)``:

    random.sample(xs, 1)[0], random.choice(xs), np.random.randint(n)  ->  xs[rng.randint(len(xs))], rng.randint(n)
    random.randint(a, b)                                               ->  a + rng.randint(b - a + 1)
    random.random()                                                    ->  rng.uniform()

A failed generation (too few floor cells, or a best reverse-play score of 0 after 4 topology tries) is
retried with ``attempt + 1`` on the same seed, where RAGEN re-seeds with Python's salted ``hash()``.

Two deliberate differences from gym-sokoban, both invisible on generated levels (they have border walls
and no box on a target): moving or pushing off the grid is blocked on all four sides (gym-sokoban checks
only the bottom/right edges and then skips even a plain move), and a layout that starts with boxes on
targets counts them in ``boxes_on_target`` (RAGEN resets the counter to 0, giving a spurious +1 later).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import fnv1a64
from .grid import PyGridEnv
from .layouts import (
    SOKOBAN_ACTIONS,
    SOKOBAN_INSTRUCTION,
    SOKOBAN_MAX_ATTEMPTS,
    SOKOBAN_SYMBOLS,
    SokobanConfig,
    format_observation,
    parse_sokoban_layouts,
    sokoban_coord_text,
    sokoban_grid_vocab,
)
from .rng import STREAM_SOKOBAN_GEN, CounterRng

# gym-sokoban's coordinate changes of actions 0 up, 1 down, 2 left, 3 right (step ids are these + 1).
CHANGE_COORDINATES = ((-1, 0), (1, 0), (0, -1), (0, 1))
# Random-walk directions and the five 3x3 floor masks of room_topology_generation, in their order.
WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))
TOPOLOGY_MASKS = tuple(
    np.array(m, dtype=np.int64)
    for m in (
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    )
)
GENERATION_TRIES = 4
MAX_EXPLORED_STATES = 300_000
REWARD_STEP, REWARD_BOX_ON, REWARD_BOX_OFF, REWARD_FINISHED = -0.1, 1.0, -1.0, 10.0


# ------------------------------------------------------------------------------------------ generation


def generate_level(
    seed: int,
    dim_room: tuple[int, int] = (6, 6),
    num_boxes: int = 1,
    search_depth: int = 300,
    p_change_directions: float = 0.35,
    num_gen_steps: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The level of ``seed``: ``(room_fixed uint8[R, C], room_state uint8[R, C], attempt)``.

    ``attempt`` is the retry that succeeded (0 for most seeds). Boxes are code 4 in ``room_state``.
    """
    if num_gen_steps is None:
        num_gen_steps = int(1.7 * (dim_room[0] + dim_room[1]))
    for attempt in range(SOKOBAN_MAX_ATTEMPTS):
        rng = CounterRng(seed, STREAM_SOKOBAN_GEN, attempt)
        level = generate_room(rng, dim_room, p_change_directions, num_gen_steps, num_boxes, search_depth)
        if level is not None:
            return level[0], level[1], attempt
    raise RuntimeError(
        f"could not generate a Sokoban level for seed {seed} in {SOKOBAN_MAX_ATTEMPTS} attempts "
        f"(dim_room={tuple(dim_room)}, num_boxes={num_boxes}, search_depth={search_depth})"
    )


def generate_room(
    rng: CounterRng,
    dim: tuple[int, int],
    p_change_directions: float,
    num_steps: int,
    num_boxes: int,
    search_depth: int,
) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """One attempt of RAGEN's generate_room; None where RAGEN raises (and re-seeds)."""
    for _ in range(GENERATION_TRIES):
        room = room_topology_generation(rng, dim, p_change_directions, num_steps)
        if not place_boxes_and_player(rng, room, num_boxes):
            return None  # RAGEN: RuntimeError('Not enough free spots') escapes generate_room
        room_structure = room.copy()
        room_structure[room_structure == 5] = 1
        room_state = room.copy()
        room_state[room_state == 2] = 4
        room_state, box_mapping = ReversePlay(room_structure, search_depth).run(room_state)
        room_state[room_state == 3] = 4
        if box_displacement_score(box_mapping) > 0:
            break
    score = box_displacement_score(box_mapping)
    if score == 0:
        return None  # RAGEN: RuntimeWarning('Generated Model with score == 0')
    move_probability = 0.8 if score == 1 else 0.5
    room_state = add_random_player_movement(rng, room_state, room_structure, move_probability)
    return room_structure, room_state, box_mapping


def room_topology_generation(rng: CounterRng, dim: tuple[int, int], p_change_directions: float, num_steps: int):
    """Random walk stamping 3x3 floor masks -> ``uint8[R, C]`` with 1 floor, 0 wall (borders walls)."""
    dim_x, dim_y = dim
    direction = WALK_DIRECTIONS[rng.randint(len(WALK_DIRECTIONS))]
    # random.randint(1, dim - 1) is inclusive: the walk may start on the border, clamped after one step.
    position = np.array([1 + rng.randint(dim_x - 1), 1 + rng.randint(dim_y - 1)])
    level = np.zeros(dim, dtype=np.int64)
    for _ in range(num_steps):
        if rng.uniform() < p_change_directions:
            direction = WALK_DIRECTIONS[rng.randint(len(WALK_DIRECTIONS))]
        position = position + direction
        position[0] = max(min(position[0], dim_x - 2), 1)
        position[1] = max(min(position[1], dim_y - 2), 1)
        mask = TOPOLOGY_MASKS[rng.randint(len(TOPOLOGY_MASKS))]
        r, c = position - 1
        level[r : r + 3, c : c + 3] += mask
    level[level > 0] = 1
    level[:, [0, dim_y - 1]] = 0
    level[[0, dim_x - 1], :] = 0
    return level.astype(np.uint8)


def place_boxes_and_player(rng: CounterRng, room: np.ndarray, num_boxes: int) -> bool:
    """Player (5) then one target (2) per box on random floor cells, in place; False if too few floor cells."""
    possible = np.where(room == 1)
    if possible[0].shape[0] <= num_boxes + 1:
        return False
    ind = rng.randint(possible[0].shape[0])
    room[possible[0][ind], possible[1][ind]] = 5
    for _ in range(num_boxes):
        possible = np.where(room == 1)
        ind = rng.randint(possible[0].shape[0])
        room[possible[0][ind], possible[1][ind]] = 2
    return True


class ReversePlay:
    """gym-sokoban's reverse playing: a DFS over pull moves from the solved state.

    ``explored`` is keyed by the full room state (a pulled box is marked 3, an untouched one 4); the
    score of a state is ``box_swaps * displacement``, 0 unless every target is uncovered; the first state
    with the best (strictly improving) score is kept.
    """

    def __init__(self, room_structure: np.ndarray, search_depth: int):
        self.room_structure = room_structure
        self.search_depth = search_depth
        targets = np.where(room_structure == 2)
        self.num_boxes = len(targets[0])
        self.explored: set[bytes] = set()
        self.best_score = -1
        self.best_room: np.ndarray | None = None
        self.best_mapping: dict = {}
        # box_mapping: target -> current location of the box that started there (row-major key order).
        self.start_mapping = {(int(r), int(c)): (int(r), int(c)) for r, c in zip(*targets, strict=True)}

    def run(self, room_state: np.ndarray) -> tuple[np.ndarray, dict]:
        self.best_mapping = self.start_mapping
        old_limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old_limit, self.search_depth + 500))
        try:
            player = tuple(int(x) for x in np.argwhere(room_state == 5)[0])
            self.depth_first_search(room_state, self.start_mapping, 0, (-1, -1), self.search_depth, player)
        finally:
            sys.setrecursionlimit(old_limit)
        assert self.best_room is not None  # search_depth >= 2 explores the root
        return self.best_room, self.best_mapping

    def depth_first_search(self, room_state, box_mapping, box_swaps, last_pull, ttl, player):
        """``player``: the player's (row, col) in ``room_state``, carried along (gym-sokoban looks it up in every
        state; the search visits hundreds of thousands, so the lookup was most of the twin's level generation)."""
        ttl -= 1
        if ttl <= 0 or len(self.explored) >= MAX_EXPLORED_STATES:
            return
        key = room_state.tobytes()
        if key in self.explored:
            return
        room_score = box_swaps * box_displacement_score(box_mapping)
        if np.count_nonzero(room_state == 2) != self.num_boxes:
            room_score = 0
        if room_score > self.best_score:
            self.best_room = room_state.copy()
            self.best_score = room_score
            self.best_mapping = dict(box_mapping)
        self.explored.add(key)
        for action in range(4):  # the pull actions only, as in RAGEN
            state_next = room_state.copy()
            mapping_next = dict(box_mapping)
            last_pull_next, player_next = self.reverse_move(state_next, mapping_next, last_pull, action, player)
            swaps_next = box_swaps + (last_pull_next != last_pull)
            self.depth_first_search(state_next, mapping_next, swaps_next, last_pull_next, ttl, player_next)

    def reverse_move(self, room_state, box_mapping, last_pull, action, player):
        """Move the player at ``player`` one cell (``action`` in 0..3) and pull the box behind it, in place.
        Returns (the last pulled box's target, the player's new cell)."""
        pr, pc = player
        dr, dc = CHANGE_COORDINATES[action]
        nr, nc = pr + dr, pc + dc
        if int(room_state[nr, nc]) in (1, 2):
            room_state[pr, pc] = self.room_structure[pr, pc]
            room_state[nr, nc] = 5
            br, bc = pr - dr, pc - dc
            if int(room_state[br, bc]) in (3, 4):
                room_state[pr, pc] = 3  # pulled boxes are marked 3 wherever they stand
                room_state[br, bc] = self.room_structure[br, bc]
                for target, location in box_mapping.items():
                    if location == (br, bc):
                        box_mapping[target] = (pr, pc)
                        last_pull = target
            return last_pull, (nr, nc)
        return last_pull, player


def box_displacement_score(box_mapping: dict) -> int:
    """Sum of Manhattan distances between each box and the target it started on."""
    return sum(abs(t[0] - b[0]) + abs(t[1] - b[1]) for t, b in box_mapping.items())


def add_random_player_movement(
    rng: CounterRng,
    room_state: np.ndarray,
    room_structure: np.ndarray,
    move_probability: float = 0.5,
    continue_probability: float = 0.5,
    max_steps: int = 3,
) -> np.ndarray:
    """RAGEN: walk the player 1-3 random steps (no revisits) so it does not always start next to a box."""
    if rng.uniform() > move_probability:
        return room_state
    player = tuple(int(x) for x in np.argwhere(room_state == 5)[0])
    previous = [player]
    steps_taken = 0
    while steps_taken < max_steps:
        valid_moves = []
        for dr, dc in CHANGE_COORDINATES:
            nxt = (player[0] + dr, player[1] + dc)
            if room_state[nxt] in (1, 2) and nxt not in previous:
                valid_moves.append(nxt)
        if not valid_moves:
            break
        nxt = valid_moves[rng.randint(len(valid_moves))]
        room_state[player] = room_structure[player]
        room_state[nxt] = 5
        player = nxt
        previous.append(player)
        steps_taken += 1
        if steps_taken >= max_steps or rng.uniform() > continue_probability:
            break
    return room_state


# ----------------------------------------------------------------------------------------------- game


class SokobanGame:
    """One Sokoban instance with gym-sokoban's step rules (actions 1 Up, 2 Down, 3 Left, 4 Right)."""

    def __init__(self, room_fixed: np.ndarray, room_state: np.ndarray, max_steps: int):
        self.room_fixed = room_fixed.astype(np.uint8)
        self.room_state = room_state.astype(np.uint8)
        self.max_steps = max_steps
        self.player = tuple(int(x) for x in np.argwhere(self.room_state == 5)[0])
        self.num_boxes = int(np.count_nonzero((self.room_state == 3) | (self.room_state == 4)))
        # RAGEN resets this to 0; counting it keeps the +1/-1 rewards right for layouts with boxes on targets.
        self.boxes_on_target = int(np.count_nonzero(self.room_state == 3))
        self.num_steps = 0
        self.terminated = False
        self.truncated = False

    def in_grid(self, pos: tuple[int, int]) -> bool:
        return 0 <= pos[0] < self.room_state.shape[0] and 0 <= pos[1] < self.room_state.shape[1]

    def all_boxes_on_target(self) -> bool:
        return self.boxes_on_target == self.num_boxes

    def step(self, action: int) -> tuple[float, bool, bool]:
        """Returns ``(reward, action_is_valid, action_is_effective)``."""
        if self.terminated or self.truncated or not 1 <= action <= 4:
            return 0.0, False, False
        self.num_steps += 1
        old_player = self.player
        dr, dc = CHANGE_COORDINATES[action - 1]
        new_pos = (old_player[0] + dr, old_player[1] + dc)
        box_pos = (new_pos[0] + dr, new_pos[1] + dc)
        if self.in_grid(box_pos) and self.room_state[new_pos] in (3, 4) and self.room_state[box_pos] in (1, 2):  # _push
            self.room_state[box_pos] = 3 if self.room_fixed[box_pos] == 2 else 4
            self.move_player(new_pos)
        elif self.in_grid(new_pos) and self.room_state[new_pos] in (1, 2):  # _move
            self.move_player(new_pos)
        reward = REWARD_STEP  # _calc_reward
        boxes_on_target = int(np.count_nonzero(self.room_state == 3))
        if boxes_on_target > self.boxes_on_target:
            reward += REWARD_BOX_ON
        elif boxes_on_target < self.boxes_on_target:
            reward += REWARD_BOX_OFF
        self.boxes_on_target = boxes_on_target
        if self.all_boxes_on_target():
            reward += REWARD_FINISHED
            self.terminated = True
        elif self.num_steps >= self.max_steps:
            self.truncated = True
        return reward, True, self.player != old_player

    def move_player(self, new_pos: tuple[int, int]) -> None:
        self.room_state[self.player] = self.room_fixed[self.player]
        self.room_state[new_pos] = 5
        self.player = new_pos

    def render(self, symbols: str) -> str:
        room = np.where((self.room_state == 5) & (self.room_fixed == 2), 6, self.room_state)
        return "\n".join("".join(symbols[c] for c in row) for row in room.tolist())


# ------------------------------------------------------------------------------------------------ env


class PySokobanEnv(PyGridEnv):
    """Batch of pure-Python Sokoban instances; same API, config and results as ``SokobanEnv`` (C++).

    Config: see ``SokobanConfig`` (``num_threads`` is accepted and ignored).
    """

    name = "sokoban"
    action_names = SOKOBAN_ACTIONS
    instruction_text = SOKOBAN_INSTRUCTION
    config_cls = SokobanConfig
    config: SokobanConfig
    _state_fields = {
        "room_fixed": (lambda g: g.room_fixed, None),
        "room_state": (lambda g: g.room_state, None),
        "boxes_on_target": (lambda g: g.boxes_on_target, np.int32),
    }

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        self.symbols = SOKOBAN_SYMBOLS[self.config.symbols]
        self.grid_vocab = sokoban_grid_vocab(self.config.symbols)

    def _new_game(self, seed: int) -> SokobanGame:
        cfg = self.config
        room_fixed, room_state, _ = generate_level(
            seed, cfg.dim_room, cfg.num_boxes, cfg.search_depth, cfg.p_change_directions, cfg.gen_steps
        )
        return SokobanGame(room_fixed, room_state, cfg.max_steps)

    def reset_from_layouts(self, layouts: Sequence[str | Sequence[str]]) -> list[str]:
        """Start every instance from a text grid in the default symbols (see ``parse_sokoban_layouts``).

        Boxes already on targets are counted in ``boxes_on_target`` (RAGEN starts at 0)."""
        fixed, state = parse_sokoban_layouts(layouts, self.num_envs, self.config.dim_room)
        self.games = [SokobanGame(f, s, self.config.max_steps) for f, s in zip(fixed, state, strict=True)]
        return self.render()

    def solve(self, max_depth: int = 100) -> list[list[int] | None]:
        """Optimal action ids per instance from its current state (see ``solvers.solve_sokoban``)."""
        from .solvers import solve_sokoban

        return [solve_sokoban(g.room_fixed, g.room_state, max_depth) for g in self._games()]

    def _success(self, game: SokobanGame) -> bool:
        return game.all_boxes_on_target()

    def _render_game(self, game: SokobanGame) -> str:
        fmt = self.config.observation_format
        if fmt == "grid":
            return game.render(self.symbols)
        coords = sokoban_coord_text(game.room_fixed, game.room_state)
        return format_observation(fmt, game.render(self.symbols), coords)

    def _state_key(self, game: SokobanGame) -> int:
        """FNV-1a 64 of room_fixed then room_state (row-major bytes), as ``SokobanEnv``."""
        return fnv1a64(game.room_state.tobytes(), fnv1a64(game.room_fixed.tobytes()))

