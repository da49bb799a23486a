"""RAGEN's prompt text, character for character (ragen/llm_agent/ctx_manager.py ``_init_prefix_lookup`` and
``get_lm_inputs``; strings from config/envs.yaml and ragen/env/*/config.py).

One chat per env instance::

    system:    "You're a helpful assistant. "                      (trailing space, as in RAGEN)
    user:      {prefix}\\nTurn 1:\\nState:\\n{obs}\\nYou have {K} actions left. Always output: <think> [Your
               thoughts] </think> <answer> [your answer] </answer> with no extra text. Strictly follow this
               format. Max response length: {max_tokens} words (tokens).\\n
    assistant: {response 1}
    user:      Reward:\\n{reward 1}\\n\\nTurn 2:\\nState:\\n...
    ...

where ``prefix`` = env instruction + "\\nThe meaning of each symbol in the state is:\\n#: wall, _: empty, ..."
(envs with a grid vocab) + "\\nYour available actions are:\\nUp, Down, ..." + "\\nYou can make up to
{max_actions_per_traj} actions, separated by the action separator \\" || \\"\\n" (envs with an action lookup).

Usage in the rollout::

    spec = prompt_spec("sokoban", enable_think=True)
    turns = [Turn(obs0, actions_left=10)]                         # before the first generation
    text = render_chat(tokenizer, build_messages(spec, turns), spec.enable_think)
    ... generate, parse, step ...
    turns[-1].response = parsed.canonical; turns[-1].reward = turn_reward(per_action_rewards)
    turns.append(Turn(obs1, actions_left=8))

RAGEN re-renders every turn from its history, and the history holds the canonical rewrite of each answer
(``fastpo.parsing.canonical_response``: cleaned think/answer, the ``<think>`` prefix restored, the raw text
when nothing parsed, no end-of-turn token), not the sampled text. Put the canonical text in
``Turn.response`` to reproduce RAGEN's prompts exactly; put the sampled text there to keep the context equal
to the tokens the model produced (what KV-cache reuse across turns implies).

RAGEN quirks reproduced on purpose (see ``prompt_spec`` and ``build_messages`` for the details):
- The legend and action list come from the env's default config: for SokobanDifferentGridVocab RAGEN's
  legend still lists the default symbols (# _ O ...) while the grid is drawn in W . G C B A @.
- Bandit, Countdown and QA have no action list and no "You can make up to ..." line; Bandit's rules
  (with the arm names) are its observation, not its instruction.
- With a context window of k turns the turns are renumbered from "Turn 1".
- Rewards print as Python prints the float sum (``-0.30000000000000004``), and ``0`` for a turn with no
  executed action; see ``turn_reward``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .envs.layouts import (
    FROZENLAKE_ACTIONS,
    FROZENLAKE_GRID_VOCAB,
    FROZENLAKE_INSTRUCTION,
    SOKOBAN_ACTIONS,
    SOKOBAN_INSTRUCTION,
    sokoban_grid_vocab,
)
from .envs.prompt_text import PROMPT_ALIASES, PROMPT_PRESETS
from .parsing import ACTION_SEP, generation_prefix

SYSTEM_PROMPT = "You're a helpful assistant. "
FORMAT_PROMPT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FORMAT_PROMPT_NO_THINK = "<answer> [your answer] </answer>"

# The Sokoban and FrozenLake instructions, legends and action names are env facts (the envs' instruction() and
# action_names use them too), so they live in fastpo.envs.layouts, which must not import the trainer side.
COUNTDOWN_INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the target."
    " Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, 7 - 3 = 4."
    " So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
)
METAMATHQA_INSTRUCTION = "You are solving Math problems. "

SOKOBAN_GRID_VOCAB = sokoban_grid_vocab("default")
#: SokobanDifferentGridVocab's symbols. RAGEN renders the grid with them but never shows this legend
#: (pass ``grid_vocab=SOKOBAN_ALT_GRID_VOCAB`` to ``prompt_spec`` for a legend that matches the grid).
SOKOBAN_ALT_GRID_VOCAB = sokoban_grid_vocab("different")


@dataclass(frozen=True)
class EnvPromptSpec:
    """What the prompt of one env says (one ``custom_envs`` entry of RAGEN's config/envs.yaml).

    Attributes:
        env_instruction: the task text opening the first user message [env_instruction].
        grid_vocab: symbol -> meaning, printed as the legend in insertion order; None for no legend.
        action_lookup: action names printed as "Your available actions are"; None for no list (and then no
            "You can make up to" line either). Only the prompt uses it: parse with the env's ``action_names``.
        max_actions_per_traj: the per-episode action budget printed in the prefix [max_actions_per_traj].
        max_tokens: the "Max response length" number [max_tokens]; not a generation limit.
        enable_think: think-then-answer format (True) or answer only [enable_think].
        action_sep: the separator named in the prefix [action_sep].
    """

    env_instruction: str
    grid_vocab: dict[str, str] | None = None
    action_lookup: list[str] | None = None
    max_actions_per_traj: int = 10
    max_tokens: int = 100
    enable_think: bool = True
    action_sep: str = ACTION_SEP

    def __post_init__(self):
        for name in ("max_actions_per_traj", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def prefix(self) -> str:
        """The first user message up to "Turn 1" (RAGEN's ``prefix_lookup`` entry)."""
        text = self.env_instruction
        # Emptiness, not None, decides: RAGEN tests the values for truthiness.
        if self.grid_vocab:
            text += "\nThe meaning of each symbol in the state is:\n" + ", ".join(
                f"{k}: {v}" for k, v in self.grid_vocab.items()
            )
        if self.action_lookup:
            text += "\nYour available actions are:\n" + ", ".join(self.action_lookup)
            text += (
                f"\nYou can make up to {self.max_actions_per_traj} actions, separated by the action separator"
                f' " {self.action_sep} "\n'
            )
        return text

    def turn_block(self, state: str, actions_left: int) -> str:
        """The "State: ... Max response length" text of one turn (after its "Turn i:" line)."""
        fmt = FORMAT_PROMPT_THINK if self.enable_think else FORMAT_PROMPT_NO_THINK
        return (
            f"State:\n{state}\nYou have {actions_left} actions left. Always output: {fmt} with no extra text."
            f" Strictly follow this format. Max response length: {self.max_tokens} words (tokens).\n"
        )


def _sokoban(**kw: Any) -> dict[str, Any]:
    return dict(
        env_instruction=SOKOBAN_INSTRUCTION,
        grid_vocab=SOKOBAN_GRID_VOCAB,
        action_lookup=SOKOBAN_ACTIONS,
        max_actions_per_traj=10,
        **kw,
    )


# RAGEN tag -> fastpo preset. Bandit's env_instruction is "" and its config has no grid vocab and no action
# lookup at prefix time (the arm order is drawn per seed in reset), so its prefix is empty. Countdown's and
# MetamathQA's configs have neither field either. max_tokens is 100 for every tag listed here.
_PRESETS: dict[str, dict[str, Any]] = {
    "sokoban": _sokoban(),  # SimpleSokoban
    "larger_sokoban": _sokoban(),  # LargerSokoban: same text, bigger rooms
    # SokobanDifferentGridVocab: RAGEN merges only the top-level custom_envs keys into the default
    # SokobanEnvConfig when it builds the prefix, so the nested grid_vocab override never reaches the legend.
    "sokoban_different_grid_vocab": _sokoban(),
    "frozenlake": dict(
        env_instruction=FROZENLAKE_INSTRUCTION,
        grid_vocab=FROZENLAKE_GRID_VOCAB,
        action_lookup=FROZENLAKE_ACTIONS,
        max_actions_per_traj=10,
    ),
    "bandit": dict(env_instruction="", max_actions_per_traj=1),
    "countdown": dict(env_instruction=COUNTDOWN_INSTRUCTION, max_actions_per_traj=1),
    "metamathqa": dict(env_instruction=METAMATHQA_INSTRUCTION, max_actions_per_traj=1),
}
_ALIASES = {
    "simple_sokoban": "sokoban",
    "simplesokoban": "sokoban",
    "largersokoban": "larger_sokoban",
    "sokobandifferentgridvocab": "sokoban_different_grid_vocab",
    "frozen_lake": "frozenlake",
    "bandit_test": "bandit",
    "bandittest": "bandit",
    "qa": "metamathqa",
}
_PRESETS.update(PROMPT_PRESETS)  # RAGEN-2's tags (Coord*, 2048, Sudoku): text kept with the envs
_ALIASES.update(PROMPT_ALIASES)


def prompt_spec(env_name: str, **overrides: Any) -> EnvPromptSpec:
    """RAGEN's prompt settings for an env: "sokoban" (SimpleSokoban), "larger_sokoban",
    "sokoban_different_grid_vocab", "frozenlake", "bandit", "countdown", "metamathqa" / "qa" (also RAGEN's
    tag spellings, case-insensitive). ``overrides`` replace ``EnvPromptSpec`` fields, e.g.
    ``enable_think=False`` or ``grid_vocab=SOKOBAN_ALT_GRID_VOCAB``."""
    key = env_name.lower()
    key = _ALIASES.get(key, key)
    if key not in _PRESETS:
        raise ValueError(f"no prompt preset for env {env_name!r}; accepted: {sorted(_PRESETS) + sorted(_ALIASES)}")
    fields = {f.name for f in dataclasses.fields(EnvPromptSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown EnvPromptSpec field(s) {unknown}; accepted: {sorted(fields)}")
    return EnvPromptSpec(**{**_PRESETS[key], **overrides})


def env_prompt_spec(env_name: str, env: Any = None, **overrides: Any) -> EnvPromptSpec:
    """The prompt settings of a configured env: RAGEN's preset (``prompt_spec``) for fastpo's built-in names, and
    for an env added with ``fastpo.envs.register`` the prompt it supplies itself (``env.prompt_fields()``: its
    instruction, legend, action vocabulary, budget and response-word limit; docs/ENVS.md). ``overrides`` replace
    ``EnvPromptSpec`` fields either way. Raises ValueError naming the env when neither exists."""
    from fastpo import envs

    if envs.is_builtin(env_name) or env_name.lower() not in envs.available():
        return prompt_spec(env_name, **overrides)
    fields_of = getattr(env, "prompt_fields", None)
    if not callable(fields_of):
        raise ValueError(f"env {env_name!r} is not a built-in env and {type(env).__name__} has no prompt_fields(); "
                         "pass the batch env made by fastpo.envs.make (a registered TextEnv supplies its prompt)")
    known = {f.name for f in dataclasses.fields(EnvPromptSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown EnvPromptSpec field(s) {unknown}; accepted: {sorted(known)}")
    try:
        return EnvPromptSpec(**{**fields_of(), **overrides})
    except (TypeError, ValueError) as e:
        raise ValueError(f"env {env_name!r}: prompt_fields() gave an invalid prompt: {e}") from e


@dataclass
class Turn:
    """One entry of RAGEN's per-env ``history``.

    Attributes:
        state: the observation text shown in this turn.
        actions_left: the episode's action budget left when this observation was shown.
        response: the assistant message that answered it (None for the turn awaiting generation).
        reward: the reward this turn's actions earned, shown in the next user message; a number from
            ``turn_reward`` (printed with ``str``) or an already formatted string. None: not shown.
    """

    state: str
    actions_left: int
    response: str | None = None
    reward: float | int | str | None = None


def turn_reward(action_rewards: Iterable[float]) -> float | int:
    """A turn's reward as RAGEN's Python envs produce it: ``0 + r1 + r2 + ...`` in float64, starting from
    the int 0 (so a turn with no executed action prints "0", and three Sokoban steps print
    "-0.30000000000000004"). Each reward is first rounded to the shortest decimal of its float32 value,
    because fastpo's envs report float32 while RAGEN's computed -0.1 etc. as Python floats. The format
    penalty is not part of it (RAGEN adds penalties to the score, never to the prompt). Known gap: RAGEN's
    Countdown returns int scores (a reward "1"); here it prints "1.0" (Countdown is single-turn, so its
    reward never reaches a prompt)."""
    acc: float | int = 0
    for r in action_rewards:
        acc += float(str(np.float32(r)))
    return acc


def format_reward(reward: float | int | str) -> str:
    """The text after "Reward:\\n": strings verbatim, numbers as Python's ``str`` (``repr`` of the float)."""
    if isinstance(reward, str):
        return reward
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
        raise ValueError(f"reward must be a number or str, got {reward!r}")
    if isinstance(reward, np.floating):
        reward = float(reward)  # np.float32 would print its own shortest digits, not float64's
    return str(reward)


def build_messages(
    spec: EnvPromptSpec,
    turns: Sequence[Turn],
    max_context_window: int = -1,
    for_update: bool = False,
) -> list[dict[str, str]]:
    """The chat messages of one env instance, as ``ContextManager.get_lm_inputs`` builds them.

    Args:
        spec: the env's prompt settings.
        turns: the history, oldest first; every turn but the last must have a response.
        max_context_window: k > 0 keeps only the last k turns (after the ``for_update`` drop), renumbered
            from "Turn 1" as in RAGEN; the system message and prefix always stay. -1 (or 0) keeps all.
        for_update: RAGEN's ``prepare_for_update``: drop a final turn that has no response (the observation
            after the episode ended) and do not show the last turn's reward. (RAGEN drops the last entry
            unconditionally; its histories always end with such a response-less entry, so the two agree.)

    Returns:
        ``[{"role": ..., "content": ...}, ...]`` starting with system, then user / assistant alternating.
    """
    if isinstance(max_context_window, bool) or not isinstance(max_context_window, int):
        raise ValueError(f"max_context_window must be an int (-1 for the full history), got {max_context_window!r}")
    history = list(turns)
    for i, turn in enumerate(history[:-1]):
        if turn.response is None:
            raise ValueError(f"turns[{i}] has no response but is not the last turn (of {len(history)})")
    if history and history[-1].reward is not None and history[-1].response is None:
        raise ValueError("the last turn has a reward but no response")
    if for_update and history and history[-1].response is None:
        history = history[:-1]
    if max_context_window > 0:
        history = history[-max_context_window:]

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": spec.prefix()}]
    for idx, turn in enumerate(history):
        messages[-1]["content"] += f"\nTurn {idx + 1}:\n" + spec.turn_block(turn.state, turn.actions_left)
        if turn.response is not None:
            messages.append({"role": "assistant", "content": turn.response})
        if turn.reward is not None and not (for_update and idx == len(history) - 1):
            messages.append({"role": "user", "content": f"Reward:\n{format_reward(turn.reward)}\n"})
    return messages


#: The context window modes whose training sequences are one per turn (``rollout.context_window_mode``).
PER_TURN_MODES = ("limited_multi_turn", "single_turn")


def window_start(turn: int, max_context_window: int) -> int:
    """The first turn (0-based) the prompt of turn ``turn`` shows under a per-turn mode: the window of k turns ends
    with the current one (k = 1: only it); -1 (or 0) shows every earlier turn."""
    return max(0, turn - max_context_window + 1) if max_context_window > 0 else 0


def turn_messages(
    spec: EnvPromptSpec,
    turns: Sequence[Turn],
    mode: str,
    max_context_window: int = -1,
    with_response: bool = False,
) -> list[dict[str, str]]:
    """The chat of the current (last) turn of ``turns`` under a per-turn context mode (RAGEN-2's
    ``context_window_mode``), in fastpo's layout (the env prefix opens the first user message, as ``build_messages``).

    Turn t (0-based, the last of ``turns``) shows the turns s..t, s = ``window_start(t, max_context_window)``,
    numbered as in the episode (Turn s + 1 ... Turn t + 1):

    - ``limited_multi_turn``: as ``build_messages`` over those turns: each earlier turn's state block, its answer as
      an assistant message and "Reward:\n{r}\n" as a user message, then the current state block.
    - ``single_turn``: one user message: the prefix, a newline, then (when s < t) "Summary: {t} step(s) completed so
      far. Showing the last {t - s} turn(s) with state/action/reward details. Recent turns:\n---\n" and per
      earlier turn h "Turn {h+1} State:\n{state}\nTurn {h+1} Action: {answer}\nTurn {h+1} Reward: {r}\n---\n",
      a newline, "Current Turn "; then "(Turn {t+1}):\n" and the current state block.

    Args:
        turns: the episode's history, oldest first; every turn but the last must have a response.
        mode: ``limited_multi_turn`` or ``single_turn``.
        max_context_window: k >= 1 turns shown, the current one included; -1 (or 0) shows all.
        with_response: end with the current turn's answer as an assistant message (the training chat).

    Returns:
        ``[{"role": ..., "content": ...}, ...]``: system, then user / assistant alternating.
    """
    if mode not in PER_TURN_MODES:
        raise ValueError(f"mode must be one of {', '.join(PER_TURN_MODES)}, got {mode!r}")
    if isinstance(max_context_window, bool) or not isinstance(max_context_window, int):
        raise ValueError(f"max_context_window must be an int (-1 for the full history), got {max_context_window!r}")
    if not turns:
        raise ValueError("turns is empty: the current turn is needed")
    for i, turn in enumerate(turns[:-1]):
        if turn.response is None:
            raise ValueError(f"turns[{i}] has no response but is not the last turn (of {len(turns)})")
    t = len(turns) - 1
    current = turns[t]
    if with_response and current.response is None:
        raise ValueError("with_response=True but the current turn has no response")
    s = window_start(t, max_context_window)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": spec.prefix()}]
    if mode == "limited_multi_turn":
        for h in range(s, t + 1):
            if messages[-1]["role"] != "user":  # an earlier turn without a reward
                messages.append({"role": "user", "content": ""})
            messages[-1]["content"] += f"\nTurn {h + 1}:\n" + spec.turn_block(turns[h].state, turns[h].actions_left)
            if h < t:
                messages.append({"role": "assistant", "content": turns[h].response})
                if turns[h].reward is not None:
                    messages.append({"role": "user", "content": f"Reward:\n{format_reward(turns[h].reward)}\n"})
    else:
        text = "\n"
        if s < t:
            text += (f"Summary: {t} step(s) completed so far. Showing the last {t - s} turn(s) with "
                     f"state/action/reward details. Recent turns:\n---\n")
            for h in range(s, t):
                text += f"Turn {h + 1} State:\n{turns[h].state}\nTurn {h + 1} Action: {turns[h].response}\n"
                if turns[h].reward is not None:
                    text += f"Turn {h + 1} Reward: {format_reward(turns[h].reward)}\n"
                text += "---\n"
            text += "\nCurrent Turn "
        text += f"(Turn {t + 1}):\n" + spec.turn_block(current.state, current.actions_left)
        messages[-1]["content"] += text
    if with_response:
        messages.append({"role": "assistant", "content": current.response})
    return messages


def render_chat(
    tokenizer: Any, messages: list[dict[str, str]], enable_think: bool = True, for_update: bool = False
) -> str:
    """Apply the tokenizer's chat template. For generation (default) with ``add_generation_prompt=True`` and
    the literal ``<think>`` (``<answer>`` without thinking) appended, so sampling starts inside the thought;
    with ``for_update=True`` (canonical training mode) without either, as RAGEN renders for the update."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if not callable(apply):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no apply_chat_template; pass a Hugging Face tokenizer"
        )
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(
            f"tokenizer {name!r} has no chat template; pass an instruct model's tokenizer (e.g."
            " Qwen/Qwen2.5-0.5B-Instruct) or set tokenizer.chat_template to a Jinja template string"
        )
    text = apply(messages, add_generation_prompt=not for_update, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(..., tokenize=False) returned {type(text).__name__}, expected str")
    return text if for_update else text + generation_prefix(enable_think)
