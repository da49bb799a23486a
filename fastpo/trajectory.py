"""Trajectory, the one trajectory type from rollout to update, and the per-turn data GiGPO reads (``turn_data``).

Built by ``fastpo.rollout`` (``_finish`` / ``_finish_turns``), filtered, scored and trained by the trainer
(``fastpo.update.turn_samples`` splits an episode of a per-turn context mode into its training sequences).
``fastpo.rollout`` re-exports both names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trajectory:
    """One episode as one training sequence (or, under a per-turn context mode, as its per-turn training sequences
    back to back: ``sample_bounds``): what the rollout produced and, once the trainer has scored it, what the
    update needs. The one trajectory type from rollout to filter, scoring and update (picklable for the trainer's
    all-gather). Every per-token array has the length T of ``input_ids``; lists given to the constructor become
    arrays of the dtypes below, and per-token arrays left out are zeros.

    Attributes:
        input_ids: int64 [T] system prompt, user turns and assistant turns.
        loss_mask: bool [T] trained tokens (see the module docstring).
        sample_logprobs: fp32 [T] the engine's logprob of each sampled token (0 elsewhere, and everywhere when
            ``logprobs_exact`` is False).
        token_rewards: fp32 [T] rewards placed on tokens (trajectory- or turn-level).
        turn_end: bool [T] the last token of each assistant turn in the sequence.
        group, seed: the group id and env seed of the instance.
        reward: ``sum(token_rewards)``, the trajectory's score (per-turn modes: the episode's return, which each of
            its sequences holds once).
        success: the env's success flag after the last executed action.
        num_turns: turns generated; num_actions: actions executed; num_valid_actions / num_effective_actions:
            executed actions the env flagged valid / effective; num_format_penalties: penalised turns.
        finish_reasons, response_lengths: per generated turn, the engine's finish reason and sampled tokens.
        turn_rewards, turn_penalties: per generated turn (turn_rewards as printed in the prompts).
        turn_state_keys: per generated turn, the key of the env state it starts from (``env.state_keys()``:
            exact for the grid envs, a hash of the observation text otherwise; the uint64 bits read as int64).
        logprobs_exact: ``sample_logprobs`` are the sampling logprobs of exactly these tokens in this context.
        env_done: the env reported done; context_truncated: ended by ``max_model_len``.
        messages: the chat the sequence renders (``build_messages(..., for_update=True)``), for logging.
        old_logp, ref_logp, values: fp32 [T] the trainer's logp / the reference's logp / the critic's value of
            each trained token (0 elsewhere), filled by the scoring pass.
        advantages, returns: fp32 [T], filled by the advantage estimator.
        step_keys, step_rewards: int64 / fp32 [K] per trained turn (K = the turn_end flags: the last K generated
            turns), the state key it starts from and its reward plus format penalty (``turn_data``; GiGPO).
        versions: int32 [T] the engine weight version that sampled each token of an assistant turn, -1 on the
            other tokens (None: not recorded). Under partial rollouts one episode spans several versions.
        sample_bounds: int64 [K + 1] under a per-turn context mode (``rollout.context_window_mode``
            limited_multi_turn / single_turn): the per-arrays hold the episode's K per-turn training sequences back
            to back, turn k spanning ``sample_bounds[k]:sample_bounds[k + 1]`` (``fastpo.update.turn_samples``
            splits them; each holds the episode's return on its last trained token). None: one sequence.
        episode, turn: on a per-turn training sequence (``turn_samples``), the index of its episode in the
            iteration's batch and its turn (0-based); -1 on an episode.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    sample_logprobs: np.ndarray | None = None
    token_rewards: np.ndarray | None = None
    turn_end: np.ndarray | None = None
    group: int = 0
    seed: int = 0
    reward: float = 0.0
    success: bool = False
    num_turns: int = 0
    num_actions: int = 0
    num_valid_actions: int = 0
    num_effective_actions: int = 0
    num_format_penalties: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_penalties: list[float] = field(default_factory=list)
    turn_state_keys: list[int] = field(default_factory=list)
    logprobs_exact: bool = True
    env_done: bool = False
    context_truncated: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)
    old_logp: np.ndarray | None = None
    ref_logp: np.ndarray | None = None
    values: np.ndarray | None = None
    advantages: np.ndarray | None = None
    returns: np.ndarray | None = None
    step_keys: np.ndarray | None = None
    step_rewards: np.ndarray | None = None
    versions: np.ndarray | None = None
    sample_bounds: np.ndarray | None = None
    episode: int = -1
    turn: int = -1

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        n = len(self.input_ids)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        for name, dtype in (("sample_logprobs", np.float32), ("token_rewards", np.float32), ("turn_end", bool)):
            value = getattr(self, name)
            setattr(self, name, np.zeros(n, dtype) if value is None else np.asarray(value, dtype=dtype))
        if self.versions is not None:
            self.versions = np.asarray(self.versions, dtype=np.int32)
        for name in ("loss_mask", "sample_logprobs", "token_rewards", "turn_end") + (
                ("versions",) if self.versions is not None else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if self.sample_bounds is not None:
            self.sample_bounds = np.asarray(self.sample_bounds, dtype=np.int64)
            b = self.sample_bounds
            if len(b) < 1 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) <= 0):
                raise ValueError(f"Trajectory.sample_bounds must rise from 0 to {n} tokens, got {b.tolist()}")


def turn_data(turn_end: np.ndarray, state_keys: Sequence[int], rewards: Sequence[float],
              penalties: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(step keys int64 [K], step rewards fp32 [K]) of the K turns a training sequence holds (K = turn_end's count:
    all generated turns, or the last K under a context window), from a Trajectory's per-turn lists (state_keys as
    ``Trajectory.turn_state_keys``: int64 values; the reward of a step is its turn reward plus format penalty)."""
    k = int(np.count_nonzero(turn_end))
    n = len(state_keys)
    if not len(rewards) == len(penalties) == n >= k:
        raise ValueError(f"per-turn lists of lengths {n} (keys), {len(rewards)} (rewards), {len(penalties)} "
                         f"(penalties) do not cover the sequence's {k} turns")
    keys = np.asarray(list(state_keys)[n - k:], dtype=np.int64)
    total = np.asarray(list(rewards)[n - k:], dtype=np.float64) + np.asarray(list(penalties)[n - k:], dtype=np.float64)
    return keys, total.astype(np.float32)
