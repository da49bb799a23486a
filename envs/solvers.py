"""Optimal solvers: Sokoban BFS over (player, boxes) and FrozenLake shortest path (slipperiness ignored).

Both return a list of env action ids (Sokoban 1 Up, 2 Down, 3 Left, 4 Right; FrozenLake 1 Left, 2 Down,
3 Right, 4 Up), ``[]`` when the instance is already solved and ``None`` when no solution exists within
``max_depth`` actions. Moves are expanded in the order Up, Down, Left, Right; ties between optimal solutions
are broken by that breadth-first discovery order, so the answer is deterministic (SFT data, tests).
"""

from __future__ import annotations

from collections import deque

import numpy as np

# (row change, col change) of Up, Down, Left, Right.
_UDLR = ((-1, 0), (1, 0), (0, -1), (0, 1))
_SOKOBAN_IDS = (1, 2, 3, 4)
_FROZENLAKE_IDS = (4, 2, 1, 3)


def solve_sokoban(room_fixed: np.ndarray, room_state: np.ndarray, max_depth: int = 100) -> list[int] | None:
    """Shortest action sequence that puts every box on a target.

    Args:
        room_fixed: ``uint8[R, C]`` (0 wall, 1 empty, 2 target).
        room_state: ``uint8[R, C]`` (adds 3 box on target, 4 box, 5 player).
        max_depth: longest solution searched for.
    Returns:
        ``list[int]`` of ids 1..4, ``[]`` if solved already, ``None`` if unsolvable within ``max_depth``.
    """
    rows, cols = room_fixed.shape
    walls = (room_fixed == 0).ravel().tolist()
    targets = frozenset(np.flatnonzero(room_fixed.ravel() == 2).tolist())
    flat_state = room_state.ravel()
    player = int(np.flatnonzero(flat_state == 5)[0])
    boxes = tuple(sorted(np.flatnonzero((flat_state == 3) | (flat_state == 4)).tolist()))
    if all(b in targets for b in boxes):
        return []
    live = _live_box_cells(walls, targets, rows, cols)

    def neighbour(cell: int, move: int) -> int:
        r, c = divmod(cell, cols)
        r, c = r + _UDLR[move][0], c + _UDLR[move][1]
        return r * cols + c if 0 <= r < rows and 0 <= c < cols else -1

    parents: dict[tuple[int, tuple[int, ...]], tuple | None] = {(player, boxes): None}
    frontier = [(player, boxes)]
    for _depth in range(max_depth):
        next_frontier = []
        for state in frontier:
            pos, bxs = state
            box_set = set(bxs)
            for move in range(4):
                nxt = neighbour(pos, move)
                if nxt < 0 or walls[nxt]:
                    continue
                new_boxes = bxs
                if nxt in box_set:
                    beyond = neighbour(nxt, move)
                    # A box pushed onto a dead cell can never reach a target: prune (keeps optimality).
                    if beyond < 0 or walls[beyond] or beyond in box_set or not live[beyond]:
                        continue
                    new_boxes = tuple(sorted((box_set - {nxt}) | {beyond}))
                child = (nxt, new_boxes)
                if child in parents:
                    continue
                parents[child] = (state, _SOKOBAN_IDS[move])
                if new_boxes is not bxs and all(b in targets for b in new_boxes):
                    return _path(parents, child)
                next_frontier.append(child)
        frontier = next_frontier
        if not frontier:
            break
    return None


def _live_box_cells(walls: list[bool], targets: frozenset[int], rows: int, cols: int) -> list[bool]:
    """Cells from which a lone box can still be pushed to some target (reverse pushes from the targets)."""
    live = [False] * (rows * cols)
    queue = deque(targets)
    for t in targets:
        live[t] = True
    while queue:
        cell = queue.popleft()
        r, c = divmod(cell, cols)
        for dr, dc in _UDLR:
            # The box came from (r - dr, c - dc), pushed by a player standing at (r - 2dr, c - 2dc).
            br, bc, pr, pc = r - dr, c - dc, r - 2 * dr, c - 2 * dc
            if not (0 <= pr < rows and 0 <= pc < cols and 0 <= br < rows and 0 <= bc < cols):
                continue
            b, p = br * cols + bc, pr * cols + pc
            if not walls[b] and not walls[p] and not live[b]:
                live[b] = True
                queue.append(b)
    return live


def solve_frozenlake(desc: np.ndarray, position: int, max_depth: int = 10_000) -> list[int] | None:
    """Shortest path to the goal avoiding holes, as if the ice were not slippery.

    Args:
        desc: ``uint8[S, S]`` ASCII codes of ``S F H G`` (or a ``bytes``/``str`` array of those letters).
        position: player cell ``row * S + col``.
    Returns:
        ``list[int]`` of ids 1..4 (Left, Down, Right, Up), ``[]`` on the goal, ``None`` in a hole / no path.
    """
    grid = _as_letters(desc)
    size_r, size_c = grid.shape
    start = (position // size_c, position % size_c)
    if grid[start] == "G":
        return []
    if grid[start] == "H":
        return None
    parents: dict[tuple[int, int], tuple | None] = {start: None}
    frontier = [start]
    for _depth in range(max_depth):
        next_frontier = []
        for cell in frontier:
            for move, (dr, dc) in enumerate(_UDLR):
                nxt = (cell[0] + dr, cell[1] + dc)
                if not (0 <= nxt[0] < size_r and 0 <= nxt[1] < size_c) or nxt in parents or grid[nxt] == "H":
                    continue
                parents[nxt] = (cell, _FROZENLAKE_IDS[move])
                if grid[nxt] == "G":
                    return _path(parents, nxt)
                next_frontier.append(nxt)
        frontier = next_frontier
        if not frontier:
            break
    return None


def _as_letters(desc: np.ndarray) -> np.ndarray:
    arr = np.asarray(desc)
    if arr.dtype == np.uint8:
        return np.vectorize(chr)(arr)
    if arr.dtype.kind == "S":
        return arr.astype("U1")
    return arr


def _path(parents: dict, node) -> list[int]:
    actions = []
    while parents[node] is not None:
        node, action = parents[node]
        actions.append(action)
    return actions[::-1]
