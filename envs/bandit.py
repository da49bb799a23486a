"""Bi-arm bandit (RAGEN's ``BanditEnv``): one pull of a low-risk or a high-risk arm, named so that the
name hints at the risk (Phoenix / Dragon; the held-out test names Trader / Librarian).

    env = fastpo.envs.make("bandit", num_envs=4)             # or names="test", or lo_arm_name=..., hi_arm_name=...
    obs = env.reset(np.arange(4))                            # RAGEN's prompt, arms in a per-seed random order
    obs, reward, terminated, truncated, info = env.step(np.array([1, 2, 2, 1], dtype=np.int32))

Action ids are fixed by risk, not by the order in the prompt: 1 = low-risk arm, 2 = high-risk arm,
``action_names = [lo_arm_name, hi_arm_name]`` (the parser maps a name to its id case-insensitively).
The low arm pays ``lo_arm_score`` (0.1; the paper text says 0.15); the high arm pays
``hi_arm_hiscore`` (1.0) with probability ``hi_arm_hiscore_prob`` (0.25), else ``hi_arm_loscore`` (0).
One valid pull ends the episode (``terminated``); ``success`` = the high-risk arm was chosen.

RAGEN-2's ``split`` ("train" or "test"): each episode draws its pair of arm names from the split's list
(``SPLIT_ARM_NAMES``: 12 train pairs, 8 held-out test pairs). ``action_names`` then lists every pair of the
split, low arm first (``[lo_0, hi_0, lo_1, hi_1, ...]``, ids ``2k + 1`` / ``2k + 2`` for pair k), and a pull is
valid only when it names one of the episode's own two arms; ``solve()`` gives each instance's high-arm id.

Any other id (0 = "no valid action") changes nothing: reward 0, ``action_is_valid`` and
``action_is_effective`` False, the episode goes on and the prompt stays the observation.

Randomness: ``CounterRng(seed, STREAM_BANDIT)``, draw 1 = arm order (uniform < 0.5: low arm named
first, as RAGEN's ``_randomize_arms``), draw 2 = the high arm's payout (uniform < hi_arm_hiscore_prob),
draw 3 (only with ``split``) = the pair, ``int(uniform * number of pairs)`` as RAGEN's reset.
All are fixed by the seed, whatever is pulled and whenever.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import BatchEnv, StepResult, build_config, check_discrete_actions, check_mask, check_seeds, empty_info
from .rng import STREAM_BANDIT, CounterRng

# RAGEN's ragen/env/bandit/env.py INIT_PROMPT, character for character (incl. trailing spaces).
INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher rewards "
    "on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> or "
    "<answer> {name_b} </answer>.\n"
)

#: Arm-name presets: name -> (low-risk arm, high-risk arm). RAGEN's ``Bandit`` and ``BanditTest`` (September 2025).
NAME_PRESETS = {"default": ("Phoenix", "Dragon"), "test": ("Trader", "Librarian")}

#: RAGEN-2's ARM_NAMES (ragen/env/bandit/config.py at 20daedc): split -> (low-risk, high-risk) pairs, in its order.
SPLIT_ARM_NAMES = {
    "train": (("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
              ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
              ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
              ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer")),
    "test": (("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
             ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
             ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator")),
}

ACTION_LO, ACTION_HI = 1, 2


@dataclass
class BanditConfig:
    names: str = "default"
    """Arm-name preset: ``"default"`` (Phoenix low / Dragon high) or ``"test"`` (Trader low / Librarian high)."""
    lo_arm_name: str | None = None
    """Name of the low-risk arm; overrides the preset when given."""
    hi_arm_name: str | None = None
    """Name of the high-risk arm; overrides the preset when given."""
    lo_arm_score: float = 0.1
    """Reward of the low-risk arm, always paid (RAGEN's code: 0.1; the paper text: 0.15)."""
    hi_arm_hiscore: float = 1.0
    """Reward of the high-risk arm when it pays."""
    hi_arm_loscore: float = 0.0
    """Reward of the high-risk arm when it does not pay."""
    hi_arm_hiscore_prob: float = 0.25
    """Probability in [0, 1] that the high-risk arm pays ``hi_arm_hiscore``."""
    split: str | None = None
    """RAGEN-2's ``split``: "train" or "test" draws each episode's arm names from that split's pairs
    (``SPLIT_ARM_NAMES``); None uses the fixed names above. Not combined with ``names`` / ``*_arm_name``."""

    def __post_init__(self) -> None:
        if self.split is not None:
            if self.split not in SPLIT_ARM_NAMES:
                raise ValueError(f"split must be one of {sorted(SPLIT_ARM_NAMES)} or None, got {self.split!r}")
            if self.names != "default" or self.lo_arm_name is not None or self.hi_arm_name is not None:
                raise ValueError(f"split={self.split!r} draws the arm names; drop names / lo_arm_name / hi_arm_name")
        if self.names not in NAME_PRESETS:
            raise ValueError(f"names must be one of {sorted(NAME_PRESETS)}, got {self.names!r}")
        lo, hi = NAME_PRESETS[self.names]
        self.lo_arm_name = lo if self.lo_arm_name is None else self.lo_arm_name
        self.hi_arm_name = hi if self.hi_arm_name is None else self.hi_arm_name
        for field in ("lo_arm_name", "hi_arm_name"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip() or value != value.strip():
                raise ValueError(f"{field} must be a non-blank str without outer spaces, got {value!r}")
        if self.lo_arm_name.lower() == self.hi_arm_name.lower():
            raise ValueError(f"arm names must differ ignoring case, got {self.lo_arm_name!r} twice")
        for field in ("lo_arm_score", "hi_arm_hiscore", "hi_arm_loscore", "hi_arm_hiscore_prob"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{field} must be a finite number, got {value!r}")
            setattr(self, field, float(value))
        if not 0.0 <= self.hi_arm_hiscore_prob <= 1.0:
            raise ValueError(f"hi_arm_hiscore_prob must be in [0, 1], got {self.hi_arm_hiscore_prob}")


def bandit_draws(seed: int, hi_arm_hiscore_prob: float = 0.25) -> tuple[bool, bool]:
    """The first two draws of episode ``seed``: (low arm named first, high arm pays)."""
    rng = CounterRng(seed, STREAM_BANDIT)
    lo_first = rng.uniform() < 0.5
    hi_pays = rng.uniform() < hi_arm_hiscore_prob
    return lo_first, hi_pays


def split_pair(seed: int, num_pairs: int) -> int:
    """Draw 3 of episode ``seed``: the index of its arm-name pair among ``num_pairs``."""
    rng = CounterRng(seed, STREAM_BANDIT, counter=2)
    return int(rng.uniform() * num_pairs)


class BanditEnv(BatchEnv):
    """``num_envs`` bandits; see the module docstring. Config: the fields of ``BanditConfig``."""

    name = "bandit"
    action_space = "discrete"
    max_actions_per_turn = 1

    def __init__(self, num_envs: int, **config: Any):
        super().__init__(num_envs)
        self.config = build_config(BanditConfig, self.name, config)
        cfg = self.config
        self._pairs = SPLIT_ARM_NAMES[cfg.split] if cfg.split else ((cfg.lo_arm_name, cfg.hi_arm_name),)
        self.action_names = [name for pair in self._pairs for name in pair]
        n = self.num_envs
        self._pair = np.zeros(n, dtype=np.int64)  # each instance's pair (always 0 without a split)
        self._lo_first = np.zeros(n, dtype=bool)
        self._hi_pays = np.zeros(n, dtype=bool)
        self._started = np.zeros(n, dtype=bool)
        self._done = np.zeros(n, dtype=bool)
        self._success = np.zeros(n, dtype=bool)
        self._obs = [""] * n

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        seeds = check_seeds(seeds, self.num_envs)
        mask = check_mask(mask, self.num_envs)
        for i in np.flatnonzero(mask).tolist():
            lo_first, hi_pays = bandit_draws(int(seeds[i]), self.config.hi_arm_hiscore_prob)
            self._lo_first[i], self._hi_pays[i] = lo_first, hi_pays
            self._pair[i] = split_pair(int(seeds[i]), len(self._pairs)) if self.config.split else 0
            lo, hi = self._pairs[self._pair[i]]
            name_a, name_b = (lo, hi) if lo_first else (hi, lo)
            self._obs[i] = INIT_PROMPT.format(name_a=name_a, name_b=name_b)
        self._started |= mask
        self._done &= ~mask
        self._success &= ~mask
        return list(self._obs)

    def step(self, actions: Any) -> StepResult:
        actions = check_discrete_actions(actions, self.num_envs)
        if not self._started.all():
            never = np.flatnonzero(~self._started).tolist()
            raise RuntimeError(f"instances {never[:10]} of env 'bandit' were never reset; call reset(seeds) first")
        cfg = self.config
        lo_id = 2 * self._pair + ACTION_LO  # this instance's two ids
        pulled = ~self._done & ((actions == lo_id) | (actions == lo_id + 1))
        chose_hi = pulled & (actions == lo_id + 1)
        hi_reward = np.where(self._hi_pays, cfg.hi_arm_hiscore, cfg.hi_arm_loscore)
        reward = np.where(chose_hi, hi_reward, np.where(pulled, cfg.lo_arm_score, 0.0)).astype(np.float32)
        for i in np.flatnonzero(pulled).tolist():
            lo, hi = self._pairs[self._pair[i]]
            if chose_hi[i]:
                name, value = hi, cfg.hi_arm_hiscore if self._hi_pays[i] else cfg.hi_arm_loscore
            else:
                name, value = lo, cfg.lo_arm_score
            self._obs[i] = f"{name}: {value} points"  # RAGEN's text; value is the Python float (0.1, 1.0, 0.0)
        self._done |= pulled
        self._success |= chose_hi
        info = empty_info(self.num_envs)
        info["success"][:] = self._success
        info["action_is_valid"][:] = pulled
        info["action_is_effective"][:] = pulled
        terminated = self._done.copy()
        return list(self._obs), reward, terminated, np.zeros(self.num_envs, dtype=bool), info

    def render(self) -> list[str]:
        return list(self._obs)

    def solve(self) -> list[list[int]]:
        """The high-risk arm's id per instance (as one-action plans): 2 without a split, ``2k + 2`` for pair k."""
        return [[2 * int(k) + ACTION_HI] for k in self._pair]

    def instruction(self) -> str:
        """RAGEN's ``env_instruction`` for Bandit is empty: the whole task is in the observation."""
        return ""
