"""What the games with integer action ids (Sokoban, FrozenLake, 2048, the 2x2 cube) share, once for the C++ batch
wrappers and once for their pure-Python twins: the config, the instruction with its symbol legend, and resetting,
stepping, rendering, state keys and exact state on top of a batch simulator (``CppGridEnv``) or of one Python game
object per instance (``PyGridEnv``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import BatchEnv, StepResult, build_config, check_discrete_actions, check_mask, check_seeds, empty_info


class GridEnv(BatchEnv):
    """A grid game: ``config_cls`` (its config dataclass, built from the keyword arguments), ``instruction_text`` (the
    rules) and ``grid_vocab`` (symbol -> meaning; empty for games without a legend) make the env."""

    instruction_text: str = ""
    grid_vocab: dict[str, str] = {}
    config_cls: type

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs)
        self.config = build_config(self.config_cls, self.name, config)

    def instruction(self) -> str:
        if not self.grid_vocab:  # 2048 and the cube: RAGEN's instruction is the rules alone
            return self.instruction_text
        legend = ", ".join(f"{k}: {v}" for k, v in self.grid_vocab.items())
        return f"{self.instruction_text}\nThe meaning of each symbol in the state is:\n{legend}"


class CppGridEnv(GridEnv):
    """A grid game on a ``fastpo._C`` batch simulator (``self._batch``, built by the subclass): the simulator
    generates, steps, renders and keys every instance; this class checks the inputs and shapes the outputs."""

    _batch: Any

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        """Generate new instances. ``seeds``: ``int64[num_envs]``; ``mask``: optional ``bool[num_envs]`` (only True
        instances are regenerated). Returns all ``num_envs`` observations."""
        return self._batch.reset(check_seeds(seeds, self.num_envs), check_mask(mask, self.num_envs))

    def step(self, actions: Any, render: bool = True) -> StepResult:
        """``actions``: ``int32[num_envs]`` -> ``(obs, reward float32[N], terminated bool[N], truncated
        bool[N], info)`` with info ``success``, ``action_is_valid``, ``action_is_effective`` (``bool[N]``);
        ``obs`` is None with ``render=False``."""
        actions = check_discrete_actions(actions, self.num_envs)
        obs, reward, terminated, truncated, success, valid, effective = self._batch.step(actions, render)
        info = {"success": success, "action_is_valid": valid, "action_is_effective": effective}
        return obs, reward, terminated, truncated, info

    def render(self) -> list[str]:
        return self._batch.render()

    def state_keys(self) -> np.ndarray:
        """``uint64[num_envs]``: the exact key of each instance's state (the class docstring says what it hashes),
        equal to the pure-Python twin's."""
        return self._batch.state_keys()

    def get_state(self) -> dict[str, np.ndarray]:
        """The exact state, one array per field with the instances first (the same keys as the twin's)."""
        return self._batch.get_state()


class PyGridEnv(GridEnv):
    """A grid game as one Python game object per instance (``self.games``); the subclass says how a game starts from
    a seed (``_new_game``), scores success (``_success``), renders (``_render_game``; default ``game.render()``), keys
    its state (``_state_key``) and which fields of its own make its exact state (``_state_fields``: name -> (getter,
    dtype), dtype None for arrays stacked as they are; every game also has ``num_steps``, ``terminated`` and
    ``truncated``, added here as the C++ simulators add them)."""

    games: list[Any]
    _state_fields: dict[str, tuple[Any, Any]] = {}
    _EPISODE_FIELDS: dict[str, tuple[Any, Any]] = {
        "num_steps": (lambda g: g.num_steps, np.int32),
        "terminated": (lambda g: g.terminated, bool),
        "truncated": (lambda g: g.truncated, bool),
    }

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs, **config)
        self.games = [None] * self.num_envs

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        """``seeds``: ``int64[num_envs]``; ``mask``: optional ``bool[num_envs]`` (only True instances start a new
        game). Returns all observations."""
        seeds = check_seeds(seeds, self.num_envs)
        for i in np.flatnonzero(check_mask(mask, self.num_envs)):
            self.games[i] = self._new_game(int(seeds[i]))
        return self.render()

    def step(self, actions: Any, render: bool = True) -> StepResult:
        """``actions``: ``int32[num_envs]`` ids (``action_names[i - 1]`` names id i; others are invalid); the same
        outputs as the C++ simulator's."""
        actions = check_discrete_actions(actions, self.num_envs)
        games = self._games()
        reward = np.zeros(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        info = empty_info(self.num_envs)
        for i, game in enumerate(games):
            reward[i], info["action_is_valid"][i], info["action_is_effective"][i] = game.step(int(actions[i]))
            terminated[i], truncated[i] = game.terminated, game.truncated
            info["success"][i] = self._success(game)
        return (self.render() if render else None), reward, terminated, truncated, info

    def render(self) -> list[str]:
        return [self._render_game(game) for game in self._games()]

    def state_keys(self) -> np.ndarray:
        """``uint64[num_envs]``: ``_state_key`` of every instance (equal to the C++ simulator's)."""
        return np.array([self._state_key(g) for g in self._games()], dtype=np.uint64)

    def get_state(self) -> dict[str, np.ndarray]:
        """The exact state: each field of ``_state_fields`` over the instances."""
        games = self._games()
        fields = {**self._state_fields, **self._EPISODE_FIELDS}
        return {name: np.stack([get(g) for g in games]) if dtype is None else
                np.array([get(g) for g in games], dtype=dtype) for name, (get, dtype) in fields.items()}

    @abstractmethod
    def _new_game(self, seed: int) -> Any:
        """A new game generated from `seed`."""

    @abstractmethod
    def _success(self, game: Any) -> bool:
        """Whether `game` is solved (info ``success``)."""

    def _render_game(self, game: Any) -> str:
        """`game`'s text observation."""
        return game.render()

    @abstractmethod
    def _state_key(self, game: Any) -> int:
        """`game`'s exact state key (uint64 as int), equal to the C++ simulator's."""

    def _games(self) -> list[Any]:
        missing = [i for i, g in enumerate(self.games) if g is None]
        if missing:
            raise RuntimeError(f"instances {missing[:8]} were never reset; call reset() or reset_from_layouts() first")
        return self.games
