"""Model text -> env actions, the way RAGEN's ``ContextManager._parse_response`` and
``EnvStateManager.step`` do it (ragen/llm_agent/ctx_manager.py, es_manager.py). Pure functions.

How the rollout uses this module, per turn and per trajectory::

    generated = tokenizer.decode(sampled_ids, skip_special_tokens=True)   # as RAGEN decodes
    resp = parse_generation(generated, enable_think)       # prepends the "<think>" the prompt ended with
    acts = parse_actions(resp.answer, env.action_names, action_sep, max_actions_per_turn)
    todo = within_budget(acts.ids or acts.names, actions_left)   # ids for discrete envs, strings for text envs
    penalty += turn_format_penalty(acts, format_penalty)
    # step ``todo`` one action at a time and stop at the first done: the env loop's job, not this module's.
    stored = canonical_response(resp, acts, enable_think)  # only for the canonical (re-tokenised) training mode

``parse_turn`` does the first five lines in one call.

The rules, as RAGEN's code has them (docs/SEMANTICS.md section 3 agrees unless noted):
- The prompt ends with a literal ``<think>`` (``<answer>`` without thinking), so the sampled text lacks
  it; RAGEN prepends it back before parsing. ``parse_response`` takes the full text, ``parse_generation``
  the sampled text.
- Pattern ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (``<answer>(.*?)</answer>`` without thinking),
  DOTALL, first match of ``re.search``. Nested or repeated tags therefore resolve as the regex does: the
  match starts at the first ``<think>``; the think group runs to the first ``</think>`` that is followed
  (after whitespace) by ``<answer>`` and, later, ``</answer>``; the answer group ends at the first
  ``</answer>``. Later ``<think>``/``<answer>`` blocks are ignored. Then the six special strings
  ``<think> </think> <answer> </answer> <|im_start|> <|im_end|>`` are deleted from both groups, one after
  another, each deletion followed by ``strip()``.
- ``re.search`` on that pattern is quadratic on inputs like ``"<think>" * 50000`` (every ``<think>`` is a
  start that scans to the end). ``_search_think_answer`` finds the identical match in linear time; the
  tests check it against ``re`` on random and adversarial inputs.
- The answer is split on ``||`` [action_sep]; pieces are stripped, empty ones dropped, and the first
  ``max_actions_per_turn`` kept. Truncation happens BEFORE invalid names are dropped, so an answer of six
  valid names and a seventh invalid one keeps five valid names and gets no penalty.
- Names match with ``str.lower()`` (not casefold, no Unicode normalisation: "Ｕｐ" is not "Up"); unknown
  names are dropped. Text envs (no action names) take every kept piece as an action: a Countdown answer
  containing ``||`` is split too.
- Format penalty, once per turn: when no valid action is left, or when any kept piece was not a valid
  name (``len(valid) != len(kept) or not valid`` in es_manager). A failed parse and an empty answer both
  leave no actions, so they are penalised too. The per-episode budget does not affect the penalty.
- Budget: the valid actions are cut to the actions left in the episode (``valid[:actions_left]``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
#: Deleted from the think and answer groups, in this order (ctx_manager.special_token_list).
SPECIAL_STRINGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, "<|im_start|>", "<|im_end|>")
#: RAGEN's default [action_sep].
ACTION_SEP = "||"
#: RAGEN's default [format_penalty].
FORMAT_PENALTY = -0.1

# ``\s`` of Python's re on str patterns; the linear search must skip exactly what the regex skips.
_WHITESPACE = re.compile(r"\s*")

T = TypeVar("T")


@dataclass(frozen=True)
class ParsedResponse:
    """One assistant turn after the think/answer pattern.

    Attributes:
        think: the think group, special strings removed and stripped; "" when thinking is disabled;
            None when the pattern did not match.
        answer: the answer group, cleaned the same way; None when the pattern did not match.
        format_ok: whether the pattern matched (an empty answer still counts as matched).
        raw: the full text that was parsed (prefix included); RAGEN stores it verbatim when nothing matched.
    """

    think: str | None
    answer: str | None
    format_ok: bool
    raw: str


@dataclass(frozen=True)
class ParsedActions:
    """The actions named by one answer.

    Attributes:
        ids: env action ids of the valid kept pieces, in order (id = index in ``action_names`` + 1);
            empty for text envs.
        names: canonical spelling of the valid kept pieces (``action_names`` entries); for text envs the
            kept pieces themselves. What the env executes, before the budget cut.
        all_valid: every kept piece was a valid name (True when nothing was kept).
        num_raw: non-empty pieces before truncation to ``max_actions``.
        kept: the stripped pieces that survived truncation, as written (what RAGEN calls ``actions``).
        answer_text: RAGEN's rewritten answer: the original answer, or ``" || ".join(kept)`` if truncated.
        raw_all_valid: every non-empty piece, including those cut by the truncation, was valid.
    """

    ids: list[int]
    names: list[str]
    all_valid: bool
    num_raw: int
    kept: list[str]
    answer_text: str
    raw_all_valid: bool

    @property
    def truncated(self) -> bool:
        """More pieces were given than ``max_actions`` allowed."""
        return self.num_raw > len(self.kept)


def generation_prefix(enable_think: bool = True) -> str:
    """The literal the prompt ends with and generation continues from: ``<think>`` or ``<answer>``."""
    return THINK_OPEN if enable_think else ANSWER_OPEN


def parse_generation(generated: str, enable_think: bool = True) -> ParsedResponse:
    """Parse sampled text (what follows the prompt). The rollout must use this one: it prepends
    ``generation_prefix(enable_think)`` as RAGEN's ``get_env_inputs`` does, then calls ``parse_response``.
    Decode the sampled ids with ``skip_special_tokens=True`` first, as RAGEN does."""
    return parse_response(generation_prefix(enable_think) + generated, enable_think)


def parse_response(text: str, enable_think: bool = True) -> ParsedResponse:
    """Parse a full assistant text (starting with the ``<think>``/``<answer>`` prefix) with RAGEN's
    pattern. Linear time in ``len(text)``; same result as ``re.search(pattern, text, re.DOTALL)``."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if enable_think:
        spans = _search_think_answer(text)
        if spans is None:
            return ParsedResponse(think=None, answer=None, format_ok=False, raw=text)
        think, answer = text[spans[0] : spans[1]], text[spans[2] : spans[3]]
    else:
        span = _search_answer(text)
        if span is None:
            return ParsedResponse(think=None, answer=None, format_ok=False, raw=text)
        think, answer = "", text[span[0] : span[1]]
    return ParsedResponse(think=_clean(think), answer=_clean(answer), format_ok=True, raw=text)


def _clean(group: str) -> str:
    # Sequential delete-then-strip, as ctx_manager does; the order matters for inputs like "</<think>think>".
    for s in SPECIAL_STRINGS:
        group = group.replace(s, "").strip()
    return group


def _search_answer(text: str) -> tuple[int, int] | None:
    """Span of group 1 of ``re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)``."""
    start = text.find(ANSWER_OPEN)
    if start < 0:
        return None
    # A later <answer> could only find a later </answer>, so failing here means no match at all.
    end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
    return None if end < 0 else (start + len(ANSWER_OPEN), end)


def _search_think_answer(text: str) -> tuple[int, int, int, int] | None:
    """Spans (think start, think end, answer start, answer end) of the groups of
    ``re.search(r"<think>(.*?)</think>\\s*<answer>(.*?)</answer>", text, re.DOTALL)``.

    Whether a ``</think>`` at p can close the think group depends only on the text after p (whitespace,
    ``<answer>``, a later ``</answer>``). The regex takes the leftmost ``<think>`` that has such a p after
    it, and the first such p; since later starts see a subset of the same candidates, that is the first
    ``<think>`` or nothing. Each scan below moves forward, so the whole search is linear."""
    start = text.find(THINK_OPEN)
    if start < 0:
        return None
    last_answer_close = text.rfind(ANSWER_CLOSE)
    if last_answer_close < 0:
        return None
    think_start = start + len(THINK_OPEN)
    pos = think_start
    while True:
        p = text.find(THINK_CLOSE, pos)
        if p < 0:
            return None
        k = _WHITESPACE.match(text, p + len(THINK_CLOSE)).end()
        answer_start = k + len(ANSWER_OPEN)
        if text.startswith(ANSWER_OPEN, k) and last_answer_close >= answer_start:
            return think_start, p, answer_start, text.find(ANSWER_CLOSE, answer_start)
        pos = p + 1


def parse_actions(
    answer: str | None,
    action_names: Sequence[str] | None,
    action_sep: str = ACTION_SEP,
    max_actions: int = 5,
) -> ParsedActions:
    """Split an answer into actions (see the module docstring for the rules).

    Args:
        answer: ``ParsedResponse.answer``; None (no match) gives no actions.
        action_names: the env's names in id order (``BatchEnv.action_names``); None or empty for a text env,
            where every kept piece is an action.
        action_sep: the separator [action_sep].
        max_actions: pieces kept per turn [max_actions_per_turn], >= 1.
    """
    if not isinstance(action_sep, str) or not action_sep:
        raise ValueError(f"action_sep must be a non-empty str, got {action_sep!r}")
    if isinstance(max_actions, bool) or not isinstance(max_actions, int) or max_actions < 1:
        raise ValueError(f"max_actions must be an int >= 1, got {max_actions!r}")
    if answer is None:
        return ParsedActions([], [], True, 0, [], "", True)
    pieces = [p.strip() for p in answer.split(action_sep)]
    pieces = [p for p in pieces if p]
    kept = pieces[:max_actions]
    # RAGEN rewrites the answer only when it truncated it; otherwise the text stays as written.
    answer_text = f" {action_sep} ".join(kept) if len(pieces) > max_actions else answer
    if not action_names:
        return ParsedActions([], list(kept), True, len(pieces), kept, answer_text, True)
    # Later duplicates win, as in RAGEN's {v.lower(): k} dict.
    lookup = {name.lower(): (i + 1, name) for i, name in enumerate(action_names)}
    matched = [lookup.get(p.lower()) for p in kept]
    valid = [m for m in matched if m is not None]
    return ParsedActions(
        ids=[m[0] for m in valid],
        names=[m[1] for m in valid],
        all_valid=len(valid) == len(kept),
        num_raw=len(pieces),
        kept=kept,
        answer_text=answer_text,
        raw_all_valid=len(valid) == len(kept) and all(p.lower() in lookup for p in pieces[max_actions:]),
    )


def turn_format_penalty(
    actions: ParsedActions, format_penalty: float = FORMAT_PENALTY, count_truncated: bool = False
) -> float:
    """The format penalty this turn adds to the trajectory: ``format_penalty`` or 0.0.

    RAGEN (default): penalised when no valid action is left or a kept piece was invalid. That covers a
    failed parse and an empty answer. ``count_truncated=True`` also penalises invalid names among the
    pieces cut by ``max_actions`` (a literal reading of "named any invalid action", docs/SEMANTICS.md section 3)."""
    all_valid = actions.raw_all_valid if count_truncated else actions.all_valid
    return float(format_penalty) if (not actions.names or not all_valid) else 0.0


def within_budget(actions: Sequence[T], actions_left: int) -> list[T]:
    """The actions that may run this turn: the first ``actions_left`` (the per-episode budget,
    ``max_actions_per_traj`` minus actions already executed). Stopping early when the env reports done is
    the rollout's job: RAGEN steps these one by one and breaks at the first done."""
    return list(actions[: max(0, int(actions_left))])


def canonical_response(response: ParsedResponse, actions: ParsedActions, enable_think: bool = True) -> str:
    """RAGEN's stored assistant message (``llm_response``): ``<think>{think}</think><answer>{answer}</answer>``
    (``<answer>{answer}</answer>`` without thinking), no spaces added, with the cleaned groups and the
    answer rewritten only when truncated. When nothing matched, the raw text (with its prefix) verbatim."""
    if not response.format_ok:
        return response.raw
    if enable_think:
        return f"{THINK_OPEN}{response.think}{THINK_CLOSE}{ANSWER_OPEN}{actions.answer_text}{ANSWER_CLOSE}"
    return f"{ANSWER_OPEN}{actions.answer_text}{ANSWER_CLOSE}"


@dataclass(frozen=True)
class TurnParse:
    """Everything the rollout needs from one sampled turn.

    Attributes:
        response, actions: the two parse stages.
        to_execute: action ids (discrete env) or strings (text env) within the budget, in order.
        penalty: this turn's format penalty (0.0 or ``format_penalty``).
        canonical: RAGEN's stored assistant message (canonical training mode).
    """

    response: ParsedResponse
    actions: ParsedActions
    to_execute: list
    penalty: float
    canonical: str


def parse_turn(
    generated: str,
    action_names: Sequence[str] | None,
    actions_left: int,
    enable_think: bool = True,
    action_sep: str = ACTION_SEP,
    max_actions: int = 5,
    format_penalty: float = FORMAT_PENALTY,
    count_truncated: bool = False,
) -> TurnParse:
    """``parse_generation`` + ``parse_actions`` + ``within_budget`` + ``turn_format_penalty`` +
    ``canonical_response`` on one turn's sampled text (decoded without special tokens)."""
    response = parse_generation(generated, enable_think)
    actions = parse_actions(response.answer, action_names, action_sep, max_actions)
    chosen = actions.ids if action_names else actions.names
    return TurnParse(
        response=response,
        actions=actions,
        to_execute=within_budget(chosen, actions_left),
        penalty=turn_format_penalty(actions, format_penalty, count_truncated),
        canonical=canonical_response(response, actions, enable_think),
    )
