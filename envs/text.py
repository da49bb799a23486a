"""Text environments: the one-instance ``TextEnv`` protocol and ``TextBatchEnv``, which steps N of them.

This is how WebShop / ALFWorld-style envs plug into fastpo without touching it::

    class GuessEnv(TextEnv):
        instruction = "Guess the secret number between 1 and 10. Answer with the number."

        def reset(self, seed: int) -> str:
            self.secret = CounterRng(seed, stream=1000).randint(10) + 1
            return "Your guess?"

        def step(self, action_text: str):
            ok = action_text.strip() == str(self.secret)
            return ("Right!" if ok else "Wrong."), float(ok), ok, {"success": ok}

    fastpo.envs.register("guess", GuessEnv, max_steps=3)
    env = fastpo.envs.make("guess", num_envs=8)

``TextBatchEnv`` owns the batch rules every fastpo env shares: input checks, reset masks, finished
instances as no-ops, a per-episode step budget, and errors that name the instance. Countdown and the
QA env are built on it. See docs/ENVS.md.
"""

from __future__ import annotations

import json
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .base import BatchEnv, StepResult, check_mask, check_seeds, check_text_actions, empty_info


class TextEnv(ABC):
    """One instance of a text environment. Subclassing is optional: ``TextBatchEnv`` only needs an
    object with ``reset`` and ``step`` (the attributes below are read with these defaults).

    Attributes:
        instruction: task description for the first user message (rules, answer format). Read from
            the first instance, so it may be set in ``__init__`` from the env's config.
        action_vocabulary: the accepted actions, or None for free text. With a vocabulary, an action
            matches case-insensitively after stripping and the env receives the vocabulary's spelling;
            any other text is an invalid no-op (reward 0, ``action_is_valid`` False, state and step
            count unchanged) and never reaches ``step``. For a vocabulary that changes with the state
            (WebShop's clickables), keep None and report ``action_is_valid=False`` yourself.
        max_actions_per_turn: how many actions the parser keeps from one answer (split on ``||``).
        legend: symbol -> meaning, printed after the instruction as "The meaning of each symbol in the state
            is: ..." (RAGEN's ``grid_vocab``); None: no legend.
        max_actions_per_traj: the episode's action budget the prompt shows ("You have K actions left", and with
            a vocabulary "You can make up to K actions"); None: the ``max_steps`` the env runs with, else 10.
        max_response_words: the "Max response length: N words (tokens)" number of the prompt (RAGEN's
            ``max_tokens``); not a generation limit.

    Optional method for ``python -m fastpo.sft`` (expert data): ``expert_actions() -> list[str]``, the actions
    an expert would take from the current state (``[]``: none).
    """

    instruction: str = ""
    action_vocabulary: list[str] | None = None
    max_actions_per_turn: int = 1
    legend: dict[str, str] | None = None
    max_actions_per_traj: int | None = None
    max_response_words: int = 100

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start a new episode determined by ``seed`` alone; return the first observation. Draw all
        randomness from ``fastpo.envs.rng.CounterRng(seed, stream)`` so it is reproducible."""

    @abstractmethod
    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply one action. Returns ``(obs, reward, done, info)``: ``obs`` str, ``reward`` a finite
        real number, ``done`` a bool (True ends the episode: ``terminated``), ``info`` a dict whose
        optional bool flags default to ``success=False``, ``action_is_valid=True``,
        ``action_is_effective=True``; other keys are kept in ``TextBatchEnv.last_infos``."""

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release resources (optional)."""


class TextEnvError(RuntimeError):
    """A user's text env failed (raised an exception or broke the protocol) in one instance.

    Attributes: ``index`` (instance index in the batch), ``phase`` (the method: "create", "reset", "step",
    "expert_actions" or "close"), ``seed`` (the episode's seed, None before the first reset). The original exception,
    if any, is ``__cause__`` (a ``SystemExit`` too: ``sys.exit()`` inside an env is a failure of the env, not the end
    of the program). After this error the batch is partly stepped: reset it before going on.
    """

    def __init__(self, env_name: str, index: int, phase: str, seed: int | None, message: str):
        where = f"text env {env_name!r} instance {index}" + ("" if seed is None else f" (seed {seed})")
        super().__init__(f"{where} failed in {phase}: {message}")
        self.index, self.phase, self.seed = index, phase, seed


_FLAG_DEFAULTS = {"success": False, "action_is_valid": True, "action_is_effective": True}

#: What a call into the user's code may raise that becomes a TextEnvError. SystemExit is no Exception, but an env
#: calling sys.exit() must not end a training run or an evaluation as if it had finished (status 0, nothing
#: exported); KeyboardInterrupt (Ctrl-C) still stops the program.
_USER_FAILURES = (Exception, SystemExit)


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"SystemExit: the env called sys.exit({err.code!r})"
    return f"{type(err).__name__}: {err}"


def _flag(value: Any) -> bool | None:
    """An info flag as a bool: a bool or the number 0 / 1 (numpy's too); None for anything else (a str such as "no"
    is truthy, so reading it with bool() would count it as True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Real) and value in (0, 1):
        return bool(value)
    return None


class TextBatchEnv(BatchEnv):
    """``num_envs`` instances made by ``factory()`` (a ``TextEnv`` class or any zero-argument callable
    returning a fresh instance), stepped with the ``BatchEnv`` API and ``action_space = "text"``.

    Args:
        num_envs: number of instances; ``factory`` is called once per instance.
        factory: zero-argument callable returning a new instance.
        max_steps: optional per-episode budget of valid steps; the step that uses it up without
            ``done`` reports ``truncated``. None = unlimited.
        name: registry name, used in error messages.

    ``step`` on a finished instance is a no-op: it reports ``terminated``/``truncated`` again with
    reward 0, all flags False except ``success`` (kept from the last real step) and the same
    observation. Instances that were never reset cannot be stepped (RuntimeError).
    """

    action_space = "text"

    def __init__(self, num_envs: int, factory: Callable[[], Any], *, max_steps: int | None = None, name: str = "text"):
        super().__init__(num_envs)
        if not callable(factory):
            raise ValueError(f"factory must be callable (a TextEnv class or a function), got {factory!r}")
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, numbers.Integral) or max_steps < 1
        ):
            raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
        self.name = name
        self.max_steps = None if max_steps is None else int(max_steps)
        self.action_names = []
        self.envs = [self._create(factory, i) for i in range(self.num_envs)]
        try:  # the attributes may be properties: the user's code too
            self._read_attributes(self.envs[0])
        except TextEnvError:
            raise
        except _USER_FAILURES as e:
            raise self._error(0, "create", _describe(e)) from e
        self._vocab_lookup = {a.strip().lower(): a for a in self.action_vocabulary or []}

        n = self.num_envs
        self._obs = [""] * n
        self._seeds: list[int | None] = [None] * n
        self._steps = np.zeros(n, dtype=np.int64)
        self._started = np.zeros(n, dtype=bool)
        self._terminated = np.zeros(n, dtype=bool)
        self._truncated = np.zeros(n, dtype=bool)
        self._success = np.zeros(n, dtype=bool)
        #: raw ``info`` dict of each instance's last ``step`` (``{}`` for a no-op).
        self.last_infos: list[dict[str, Any]] = [{} for _ in range(n)]

    def _read_attributes(self, first: Any) -> None:
        """The prompt attributes of the first instance (see ``TextEnv``), checked."""
        self._instruction = getattr(first, "instruction", "")
        if not isinstance(self._instruction, str):
            raise self._error(0, "create", f"instruction must be a str, got {type(self._instruction).__name__}")
        per_turn = getattr(first, "max_actions_per_turn", 1)
        if isinstance(per_turn, bool) or not isinstance(per_turn, numbers.Integral) or per_turn < 1:
            raise self._error(0, "create", f"max_actions_per_turn must be an int >= 1, got {per_turn!r}")
        self.max_actions_per_turn = int(per_turn)
        self.action_vocabulary = self._check_vocabulary(getattr(first, "action_vocabulary", None))
        self._prompt = self._check_prompt_attributes(first)

    # -- batch API -------------------------------------------------------------------------------

    def reset(self, seeds: Sequence[int] | np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        seeds = check_seeds(seeds, self.num_envs)
        mask = check_mask(mask, self.num_envs)
        for i in np.flatnonzero(mask).tolist():
            seed = int(seeds[i])
            self._seeds[i] = seed
            try:
                obs = self.envs[i].reset(seed)
            except _USER_FAILURES as e:
                raise self._error(i, "reset", _describe(e)) from e
            if not isinstance(obs, str):
                raise self._error(i, "reset", f"reset must return a str observation, got {type(obs).__name__}")
            self._obs[i] = obs
            self._steps[i] = 0
            self._started[i] = True
            self._terminated[i] = self._truncated[i] = self._success[i] = False
            self.last_infos[i] = {}
        return list(self._obs)

    def step(self, actions: Sequence[str], active: np.ndarray | None = None) -> StepResult:
        """Apply one text action per instance. ``active``: optional ``bool[num_envs]``; instances where it
        is False are left exactly as they are (no step, reward 0, flags False except ``success``, their
        ``last_infos`` kept), which is how a rollout steps only the instances that still have actions."""
        actions = check_text_actions(actions, self.num_envs)
        active = check_mask(active, self.num_envs) if active is not None else None
        if not self._started.all():
            never = np.flatnonzero(~self._started).tolist()
            raise RuntimeError(f"instances {never[:10]} of env {self.name!r} were never reset; call reset(seeds) first")
        n = self.num_envs
        reward = np.zeros(n, dtype=np.float32)
        info = empty_info(n)
        for i, text in enumerate(actions):
            if active is not None and not active[i]:
                info["success"][i] = self._success[i]
                continue
            if self._terminated[i] or self._truncated[i]:
                info["success"][i] = self._success[i]
                self.last_infos[i] = {}
                continue
            if self._vocab_lookup:
                canonical = self._vocab_lookup.get(text.strip().lower())
                if canonical is None:  # invalid: nothing happens, the budget is not used
                    self.last_infos[i] = {}
                    continue
                text = canonical
            try:
                result = self.envs[i].step(text)
            except _USER_FAILURES as e:
                raise self._error(i, "step", _describe(e)) from e
            try:  # reading the result may run the user's code too (a Mapping's methods, a number's __float__)
                obs, r, done, env_info, flags = self._check_step_result(i, result)
            except TextEnvError:
                raise
            except _USER_FAILURES as e:
                raise self._error(i, "step", f"its result could not be read: {_describe(e)}") from e
            self._obs[i] = obs
            self._steps[i] += 1
            reward[i] = r
            for key, value in flags.items():
                info[key][i] = value
            self._success[i] = info["success"][i]
            self.last_infos[i] = env_info
            if done:
                self._terminated[i] = True
            elif self.max_steps is not None and self._steps[i] >= self.max_steps:
                self._truncated[i] = True
        return list(self._obs), reward, self._terminated.copy(), self._truncated.copy(), info

    def render(self) -> list[str]:
        return list(self._obs)

    def instruction(self) -> str:
        return self._instruction

    def prompt_fields(self) -> dict[str, Any]:
        """The env's prompt, as ``fastpo.prompts.EnvPromptSpec`` keywords: ``env_instruction``, ``grid_vocab``
        (the legend), ``action_lookup`` (the vocabulary; None for free text), ``max_actions_per_traj``,
        ``max_tokens`` (read from the first instance at construction)."""
        return dict(self._prompt)

    def expert_actions(self) -> list[list[str] | None]:
        """Per instance, the actions its ``expert_actions()`` proposes from the current state (None: no method
        result / empty). Raises TextEnvError naming the instance, ``expert_actions`` and the seed when the method
        is missing, raises or returns something other than a list of str."""
        plans: list[list[str] | None] = []
        for i, env in enumerate(self.envs):
            method = getattr(env, "expert_actions", None)
            if not callable(method):
                raise self._error(i, "expert_actions", f"{type(env).__name__} has no expert_actions() method, which "
                                  "SFT data needs (see docs/ENVS.md)")
            try:
                plan = method()
            except _USER_FAILURES as e:
                raise self._error(i, "expert_actions", _describe(e)) from e
            if not isinstance(plan, (list, tuple)) or not all(isinstance(a, str) for a in plan):
                raise self._error(i, "expert_actions", f"expert_actions must return a list of str, got {plan!r:.200}")
            plans.append(list(plan) or None)
        return plans

    def close(self) -> None:
        """Call every instance's ``close()``; the first failure is raised (TextEnvError, phase "close") once all
        were called."""
        failure = None
        for i, env in enumerate(self.envs):
            try:
                close = getattr(env, "close", None)
                if callable(close):
                    close()
            except _USER_FAILURES as e:
                if failure is None:
                    failure = self._error(i, "close", _describe(e))
                    failure.__cause__ = e
        if failure is not None:
            raise failure

    # -- helpers ---------------------------------------------------------------------------------

    def _error(self, index: int, phase: str, message: str) -> TextEnvError:
        seed = self._seeds[index] if hasattr(self, "_seeds") else None
        return TextEnvError(self.name, index, phase, seed, message)

    def _create(self, factory: Callable[[], Any], index: int) -> Any:
        try:
            env = factory()
            missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        except _USER_FAILURES as e:
            raise self._error(index, "create", _describe(e)) from e
        if missing:
            raise self._error(index, "create", f"{type(env).__name__} has no {missing[0]}() method")
        return env

    def _check_prompt_attributes(self, first: Any) -> dict[str, Any]:
        legend = getattr(first, "legend", None)
        if legend is not None and (not isinstance(legend, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in legend.items())):
            raise self._error(0, "create", f"legend must be None or a dict of str -> str, got {legend!r:.200}")
        budget = getattr(first, "max_actions_per_traj", None)
        if budget is None:
            budget = self.max_steps if self.max_steps is not None else 10
        words = getattr(first, "max_response_words", 100)
        for attr, value in (("max_actions_per_traj", budget), ("max_response_words", words)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise self._error(0, "create", f"{attr} must be an int >= 1, got {value!r}")
        return {"env_instruction": self._instruction, "grid_vocab": dict(legend) if legend else None,
                "action_lookup": list(self.action_vocabulary) if self.action_vocabulary else None,
                "max_actions_per_traj": int(budget), "max_tokens": int(words)}

    def _check_vocabulary(self, vocab: Any) -> list[str] | None:
        if vocab is None:
            return None
        if isinstance(vocab, str) or not isinstance(vocab, Sequence) or not vocab:
            raise self._error(0, "create", f"action_vocabulary must be None or a non-empty list of str, got {vocab!r}")
        seen: dict[str, str] = {}
        for a in vocab:
            if not isinstance(a, str) or not a.strip():
                raise self._error(0, "create", f"action_vocabulary entries must be non-blank str, got {a!r}")
            key = a.strip().lower()
            if key in seen:
                raise self._error(0, "create", f"action_vocabulary has {seen[key]!r} and {a!r} (same ignoring case)")
            seen[key] = a
        return list(vocab)

    def _check_step_result(self, i: int, result: Any) -> tuple[str, float, bool, dict[str, Any], dict[str, bool]]:
        """(obs, reward, done, a plain copy of info, the three flags) of a step's result, each checked."""
        if not isinstance(result, tuple) or len(result) != 4:
            raise self._error(i, "step", f"step must return (obs, reward, done, info), got {result!r:.200}")
        obs, r, done, env_info = result
        if not isinstance(obs, str):
            raise self._error(i, "step", f"obs must be a str, got {type(obs).__name__}")
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise self._error(i, "step", f"reward must be a finite real number, got {r!r}")
        if not isinstance(done, (bool, np.bool_)):
            raise self._error(i, "step", f"done must be a bool, got {type(done).__name__} {done!r}")
        if not isinstance(env_info, Mapping):
            raise self._error(i, "step", f"info must be a dict, got {type(env_info).__name__}")
        env_info = dict(env_info)  # a plain copy: a Mapping's own get() is not called again
        flags = {}
        for key, default in _FLAG_DEFAULTS.items():
            value = env_info.get(key, default)
            flags[key] = _flag(value)
            if flags[key] is None:
                raise self._error(i, "step", f"info[{key!r}] must be a bool or the number 0 / 1, got "
                                             f"{value!r:.200}")
        return obs, float(r), bool(done), env_info, flags


def load_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Read a data file of JSON objects: JSONL (one object per line, blank lines skipped) or one JSON
    array. Returns ``(location, record)`` pairs, ``location`` being ``"path:line"`` (``"path[item]"``
    for an array) for error messages. Raises ValueError naming the path (and line) when the file is
    missing, empty, not JSON, or holds something other than objects."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} does not exist (or is not a file)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"data file {str(p)!r} cannot be read as UTF-8 text: {e}") from e
    records: list[tuple[str, Any]] = []
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: invalid JSON array: {e.msg}") from e
        records = [(f"{p}[{k}]", item) for k, item in enumerate(items)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"{p}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg}); expected one JSON object per line") from e
    if not records:
        raise ValueError(f"data file {str(p)!r} holds no records")
    for where, rec in records:
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return records


__all__ = ["TextBatchEnv", "TextEnv", "TextEnvError", "load_records"]
