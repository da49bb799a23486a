"""Exact success probabilities of turn-based policies on (slippery) FrozenLake, by dynamic programming.

An agent plays FrozenLake in turns: each turn it writes up to ``actions_per_turn`` actions without seeing the
board in between, then sees where it landed. On slippery ice each action goes in the intended direction or in one
of the two perpendicular ones, 1/3 each (gym's rule, ``envs.py_frozenlake``); an episode ends on the goal (success),
in a hole, or when its action budget is spent. Two policies are valued exactly over that distribution:

- ``"optimal"``: the best turn policy (over every sequence of 1..actions_per_turn actions per turn, given the
  cell), i.e. the success an ideal agent reaches under the same turn and action budgets.
- ``"shortest"``: each turn, the first ``actions_per_turn`` actions of the shortest safe path from the current
  cell (``solvers.solve_frozenlake``, which ignores slipping), i.e. the policy that SFT on solver trajectories
  (``fastpo.sft --sft.turn_length max``) imitates.

The gap between the two on a set of levels is the headroom that RL can find and shortest-path SFT cannot
(docs/results/log.md, slippery FrozenLake). The env itself draws its slips from a stream seeded by the level's seed,
so one episode is deterministic; these values are the expectation over that stream, which the agent cannot see.
"""

from __future__ import annotations

import functools
import itertools
from typing import Literal

import numpy as np

from .solvers import solve_frozenlake

# FrozenLake ids 1 Left, 2 Down, 3 Right, 4 Up = gym 0..3; gym move -> (row change, col change).
_GYM_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))

Policy = Literal["optimal", "shortest"]
_GOAL, _HOLE = ord("G"), ord("H")


def move_distribution(desc: np.ndarray, position: int, action: int, is_slippery: bool) -> list[tuple[int, float]]:
    """Where action ``action`` (1..4) from cell ``position`` (``row * S + col``) lands: ``[(cell, probability)]``,
    cells repeated when two directions land on the same one (moving off the map stays in place)."""
    if not 1 <= action <= 4:
        raise ValueError(f"action must be in 1..4 (1 Left, 2 Down, 3 Right, 4 Up), got {action!r}")
    rows, cols = desc.shape
    gym = action - 1
    turns = ((gym - 1) % 4, gym, (gym + 1) % 4) if is_slippery else (gym,)
    out = []
    for g in turns:
        dr, dc = _GYM_MOVES[g]
        r = min(max(position // cols + dr, 0), rows - 1)
        c = min(max(position % cols + dc, 0), cols - 1)
        out.append((r * cols + c, 1.0 / len(turns)))
    return out


class TurnPlanner:
    """Exact values and turn choices of one ``policy`` on one map (module docstring).

    Args:
        desc: ``uint8[S, S]`` ASCII codes of ``S F H G`` (the env's ``get_state()["desc"][i]``).
        actions_per_turn: the rollout's ``env.max_actions_per_turn`` (>= 1).
        policy: ``"optimal"`` or ``"shortest"``.
        is_slippery: gym's slippery ice; False makes every move deterministic.
    """

    def __init__(self, desc: np.ndarray, actions_per_turn: int, policy: Policy = "optimal", is_slippery: bool = True):
        _check_positive("actions_per_turn", actions_per_turn)
        if policy not in ("optimal", "shortest"):
            raise ValueError(f"policy must be 'optimal' or 'shortest', got {policy!r}")
        self.desc = np.asarray(desc, dtype=np.uint8)
        if self.desc.ndim != 2:
            raise ValueError(f"desc must be a 2-D map, got shape {self.desc.shape}")
        self.letters = self.desc.reshape(-1)
        self.actions_per_turn, self.policy, self.is_slippery = int(actions_per_turn), policy, bool(is_slippery)
        self._sequences = [s for k in range(1, self.actions_per_turn + 1)
                           for s in itertools.product(range(1, 5), repeat=k)]
        self._after = functools.cache(self._after_uncached)
        self._value = functools.cache(self._value_uncached)

    def value(self, cell: int, turns_left: int, budget: int) -> float:
        """Success probability from ``cell`` (``row * S + col``) with ``turns_left`` turns and ``budget`` actions
        left (each >= 0), in [0, 1]."""
        if not 0 <= cell < self.letters.size:
            raise ValueError(f"cell must be in [0, {self.letters.size}), got {cell!r}")
        if turns_left < 0 or budget < 0:
            raise ValueError(f"turns_left and budget must be >= 0, got {turns_left!r} and {budget!r}")
        return self._value(int(cell), int(turns_left), int(budget))

    def turn(self, cell: int, turns_left: int, budget: int) -> tuple[int, ...]:
        """The actions (ids 1..4) the policy writes this turn; ``()`` when it has nothing to play (on the goal, in
        a hole, out of turns or actions, or, for ``"shortest"``, with no path). Ties keep the first sequence in
        the order (1,), (2,), ..., (1, 1), (1, 2), ... so the choice is deterministic."""
        self.value(cell, turns_left, budget)  # validates the arguments
        if not self._playable(cell, turns_left, budget):
            return ()
        if self.policy == "shortest":
            return self._shortest_turn(cell, budget)
        scores = [(self._turn_value(cell, s, turns_left, budget), -i, s)
                  for i, s in enumerate(self._sequences) if len(s) <= budget]
        return max(scores)[2]

    def _shortest_turn(self, cell: int, budget: int) -> tuple[int, ...]:
        path = solve_frozenlake(self.desc, cell)
        return tuple(path[:min(self.actions_per_turn, budget)]) if path else ()

    def _playable(self, cell: int, turns_left: int, budget: int) -> bool:
        return self.letters[cell] not in (_GOAL, _HOLE) and turns_left > 0 and budget > 0

    def _after_uncached(self, cell: int, seq: tuple[int, ...]) -> tuple[float, tuple[tuple[int, float], ...]]:
        # (probability of reaching the goal during the turn, distribution of the cells still alive after it)
        alive, reached = {cell: 1.0}, 0.0
        for action in seq:
            nxt: dict[int, float] = {}
            for c, w in alive.items():
                for d, p in move_distribution(self.desc, c, action, self.is_slippery):
                    if self.letters[d] == _GOAL:
                        reached += w * p
                    elif self.letters[d] != _HOLE:
                        nxt[d] = nxt.get(d, 0.0) + w * p
            alive = nxt
        return reached, tuple(alive.items())

    def _turn_value(self, cell: int, seq: tuple[int, ...], turns_left: int, budget: int) -> float:
        reached, alive = self._after(cell, seq)
        return reached + sum(w * self._value(c, turns_left - 1, budget - len(seq)) for c, w in alive)

    def _value_uncached(self, cell: int, turns_left: int, budget: int) -> float:
        if self.letters[cell] == _GOAL:
            return 1.0
        if not self._playable(cell, turns_left, budget):
            return 0.0
        if self.policy == "shortest":
            seq = self._shortest_turn(cell, budget)
            return self._turn_value(cell, seq, turns_left, budget) if seq else 0.0
        return max(self._turn_value(cell, s, turns_left, budget) for s in self._sequences if len(s) <= budget)


def success_probability(desc: np.ndarray, position: int, turns: int, actions_per_turn: int, max_actions: int,
                        policy: Policy = "optimal", is_slippery: bool = True) -> float:
    """Probability that ``policy`` reaches the goal from ``position`` (``row * S + col``) within ``turns`` turns of
    at most ``actions_per_turn`` actions and ``max_actions`` actions in all (the rollout's ``env.max_turns``,
    ``env.max_actions_per_turn`` and ``min(env max_steps, env.max_actions_per_traj)``; each >= 1). ``desc``:
    ``uint8[S, S]`` ASCII map. Returns a probability in [0, 1], exact up to float rounding."""
    _check_positive("turns", turns)
    _check_positive("max_actions", max_actions)
    return TurnPlanner(desc, actions_per_turn, policy, is_slippery).value(position, turns, max_actions)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
