"""The multi-turn rollout: prompts -> batched generation -> parsing -> env steps -> training sequences.

    spec = prompt_spec("sokoban")
    batch = run_rollout(env, engine, tokenizer, spec, seeds, group_ids, RolloutConfig(), SamplingParams(
        temperature=1.0, max_new_tokens=400), request_seeds)
    batch.trajectories[i].input_ids / loss_mask / sample_logprobs / token_rewards / turn_end   # each [T_i]
    batch.metrics["rollout/in_group_std"], batch.metrics["env/Sokoban/success"], ...

One chat per env instance (``fastpo.prompts``: RAGEN's text, character-exact), the chat template applied with
``add_generation_prompt=True`` and the literal ``<think>`` (``<answer>`` without thinking) appended. Each turn is
ONE batched engine call for all active instances. The sampled ids are decoded with ``skip_special_tokens=True``
and parsed (``fastpo.parsing``); the valid actions run one at a time (per-turn cap, per-episode budget
``spec.max_actions_per_traj``, stop at the first done), then the env renders once. Turn reward = sum of the
executed actions' rewards (``prompts.turn_reward``, also printed in the next "Reward:" message). An episode
ends when the env reports done (terminated or truncated), the action budget is used up, ``max_turns`` turns
were generated, or the next prompt would not fit ``max_model_len`` (``context_truncated``).

Three generation modes:
- KV reuse (default: ``canonical=False``, ``max_context_window <= 0``). One engine session per instance. The
  history holds what the model wrote (``<think>`` + the sampled text), so the context only grows: each turn
  the chat is re-rendered as TEXT and only the new suffix (the assistant's end-of-turn text, "Reward:", the
  next "Turn i" block, the generation prompt and ``<think>``) is tokenized and passed to ``engine.extend``.
  Sampled ids are never re-tokenized. If the sampled stop token's text is where the template closes the
  assistant message (Qwen: ``<|im_end|>``), it is not repeated; if generation stopped by length, the suffix
  closes the message. Training sequence = the session's tokens (prompt, sampled ids, deltas) plus the
  template's closing text after the last answer (mask 0), so it decodes to exactly
  ``render_chat(tokenizer, build_messages(spec, turns, for_update=True), for_update=True)`` when the model's
  text is canonical and it stopped with the template's end-of-turn token. Sample logprobs are exact.
- ``canonical=True`` (RAGEN's mode): the history holds ``canonical_response`` rewrites; each turn's prompt is
  re-rendered and re-tokenized in full (stateless ``engine.generate``); the training sequence is the
  tokenization of RAGEN's update text (``for_update=True``), built in chunks so the assistant texts' token
  spans are known. Trained: each assistant content plus the template's end-of-turn token after it (what
  RAGEN's mask covers apart from its header / newline quirks). The sample logprobs belong to other tokens:
  ``logprobs_exact=False`` and ``sample_logprobs`` are all 0.0.
- ``max_context_window = k > 0``: the prompt is rebuilt every turn from the last k turns (renumbered from
  "Turn 1", RAGEN's ``get_lm_inputs``), stateless ``engine.generate``. Training sequence, as RAGEN's
  ``prepare_for_update``: system + prefix + the LAST k turns only (earlier turns are not trained), and, as
  in RAGEN (whose score list is taken from the windowed history), only those k turns' rewards count (the
  penalty counts in full); ``window_reward="full"`` sums all turns instead. Assistant tokens are the sampled
  ids (re-tokenized canonical text with ``canonical=True``). Logprobs are exact only when the episode had
  <= k turns (then every sampling context equals the sequence prefix); otherwise ``logprobs_exact=False``
  and they are 0.0.

Loss mask: 1 on the model's own sampled tokens (including the stop token that ended a turn), 0 on the
template / observation tokens. ``train_on_observations=True`` (paper-time RAGEN, ``enable_response_mask:
False``): RAGEN trains every token after the first ``<|im_start|>`` that follows the system message (its mask
``turn_indicators > 1`` shifted by one for next-token prediction); here the same: all tokens from
``len(tokens(system message)) + 1`` on are 1. Those extra tokens have no sample logprob (0.0).

Rewards (``token_rewards``, aligned with ``input_ids``):
- trajectory level (default): ``sum(turn rewards) + sum(format penalties)`` on the last trained token;
- turn level (``use_turn_scores=True``): each turn's reward on that turn's last assistant token (its stop
  token, or last sampled token). RAGEN adds penalties only in the trajectory-level path (``_normalize_score_tensor``
  is skipped with turn scores), so they are dropped by default; ``turn_level_penalties=True`` adds each turn's
  penalty to its turn reward. (RAGEN's turn-level rewards sit one token later, on the newline after
  ``<|im_end|>``; here they sit on the trained token.)
``Trajectory.reward = sum(token_rewards)``, the score the trainer sees. ``turn_end`` is 1 at the last token of
each assistant turn (the bi-level GAE's turn boundaries), else 0.

Starting states: ``env.reset(seeds)``; with ``already_reset=True`` the caller has reset the env (e.g. with
``reset_from_layouts``) and the rollout starts from ``env.render()``; ``seeds`` are then only recorded.

Batch-env stepping: grid envs are stepped with ``render=False`` (one ``env.render()`` after the turn); instances
without an action in a sub-step get action id 0 (a no-op). ``TextBatchEnv`` has no no-op text, so its idle
instances are parked as finished for that sub-step (private state, restored right after).
"""

from __future__ import annotations

import inspect
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine.base import Engine, GenerationResult, SamplingParams
from .envs.base import text_state_keys
from .parsing import FORMAT_PENALTY, canonical_response, generation_prefix, parse_actions, parse_generation
from .prompts import EnvPromptSpec, Turn, build_messages, render_chat, turn_reward

#: Metric labels of the built-in envs (``env/<label>/...``), RAGEN's tags.
ENV_LABELS = {"sokoban": "Sokoban", "frozenlake": "FrozenLake", "bandit": "Bandit", "countdown": "Countdown"}
ENV_LABELS.update(qa="MetamathQA", metamathqa="MetamathQA")


def env_label(name: str) -> str:
    """Metric label of a configured env name: ``ENV_LABELS`` (RAGEN's tags of the base names), else the name in
    CamelCase (bandit_test -> BanditTest, larger_sokoban -> LargerSokoban, as RAGEN tags them), so two variants of
    one env class (validation on bandit and bandit_test) are reported apart, not averaged together."""
    return ENV_LABELS.get(name) or "".join(part[:1].upper() + part[1:] for part in name.split("_"))


@dataclass
class RolloutConfig:
    """How episodes are run and turned into training sequences (RAGEN's names in brackets)."""

    max_turns: int = 5
    """Turns generated per episode at most [max_turn]."""
    max_actions_per_turn: int | None = None
    """Actions kept per answer [max_actions_per_turn]; None: the env's ``max_actions_per_turn``. The episode
    budget is ``spec.max_actions_per_traj`` (the number the prompt shows)."""
    format_penalty: float = FORMAT_PENALTY
    """Added once per turn whose answer did not parse, was empty or named an invalid action [format_penalty]."""
    count_truncated_penalty: bool = False
    """Also penalise invalid names among pieces cut by the per-turn cap (``parsing.turn_format_penalty``)."""
    max_model_len: int = 3600
    """Whole-context token cap: a turn is only generated when prompt + ``max_new_tokens`` fit, else the episode
    ends (``context_truncated``)."""
    max_context_window: int = -1
    """k > 0: prompts and the training sequence keep only the last k turns [max_context_window]."""
    canonical: bool = False
    """Keep RAGEN's canonical rewrites in the history and train on their re-tokenisation (inexact ratios)."""
    train_on_observations: bool = False
    """Train on every token after the system message too (RAGEN ``enable_response_mask=False``)."""
    use_turn_scores: bool = False
    """Turn-level rewards on each turn's last token instead of one trajectory reward [use_turn_scores]."""
    turn_level_penalties: bool = False
    """With ``use_turn_scores``: add each turn's format penalty to its reward (RAGEN drops them)."""
    window_reward: str = "window"
    """With ``max_context_window > 0``: "window" (RAGEN: only the kept turns' rewards) or "full"."""
    already_reset: bool = False
    """The caller reset the env (e.g. ``reset_from_layouts``); start from ``env.render()``."""
    env_label: str | None = None
    """Name in ``env/<label>/...`` metrics; None: ``ENV_LABELS`` of ``env.name`` (else the name itself)."""
    env_metric_prefix: str = "env"
    """Prefix of the per-env metrics ("val-env" for validation, docs/SEMANTICS.md section 8)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_model_len < 2:
            raise ValueError(f"need max_turns >= 1 and max_model_len >= 2, got {self.max_turns}, {self.max_model_len}")
        if self.max_actions_per_turn is not None and self.max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1 or None, got {self.max_actions_per_turn}")
        if self.window_reward not in ("window", "full"):
            raise ValueError(f"window_reward must be 'window' or 'full', got {self.window_reward!r}")


@dataclass
class Trajectory:
    """One episode as one training sequence. Every per-token list has the length T of ``input_ids``.

    Attributes:
        group, seed: the group id and env seed of the instance.
        input_ids: [T] system prompt, user turns and assistant turns.
        loss_mask: [T] 1 on trained tokens (see the module docstring).
        sample_logprobs: [T] the engine's logprob of each sampled token (0.0 elsewhere, and everywhere when
            ``logprobs_exact`` is False).
        token_rewards: [T] rewards placed on tokens (trajectory- or turn-level).
        turn_end: [T] 1 at the last token of each assistant turn in the sequence.
        reward: ``sum(token_rewards)``.
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
    """

    group: int
    seed: int
    input_ids: list[int]
    loss_mask: list[int]
    sample_logprobs: list[float]
    token_rewards: list[float]
    turn_end: list[int]
    reward: float
    success: bool
    num_turns: int
    num_actions: int
    num_valid_actions: int
    num_effective_actions: int
    num_format_penalties: int
    finish_reasons: list[str]
    response_lengths: list[int]
    turn_rewards: list[float] = field(default_factory=list)
    turn_penalties: list[float] = field(default_factory=list)
    turn_state_keys: list[int] = field(default_factory=list)
    logprobs_exact: bool = True
    env_done: bool = False
    context_truncated: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class RolloutBatch:
    """All trajectories of one rollout (in instance order) and their metrics (``rollout/...``, ``env/<Env>/...``)."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]


@dataclass
class _Episode:
    """Mutable per-instance state during the rollout."""

    seed: int
    group: int
    turns: list[Turn]
    active: bool = True
    actions_used: int = 0
    success: bool = False
    env_done: bool = False
    context_truncated: bool = False
    # per generated turn
    samples: list[GenerationResult] = field(default_factory=list)
    canonical: list[str] = field(default_factory=list)
    penalties: list[float] = field(default_factory=list)
    last_valid: list[float] = field(default_factory=list)  # RAGEN: the turn's last executed action's flags
    last_effective: list[float] = field(default_factory=list)
    num_valid: int = 0
    num_effective: int = 0
    # KV mode: the text the session holds, and the stop-token text it ended with (not in the chat text)
    text: str = ""
    stop_text: str = ""
    context_len: int = 0
    stop_texts: list[str] = field(default_factory=list)
    state_keys: list[int] = field(default_factory=list)  # one per entry of turns: the state that turn starts from


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _decode(tokenizer: Any, ids: Sequence[int], skip_special: bool) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def _state_keys(env: Any, obs: Sequence[str]) -> list[int]:
    """The env's state key per instance (``state_keys()``, or a hash of the observation text for an env without
    that method: a user's env that does not subclass BatchEnv), as signed int64 values (the uint64 bits)."""
    fn = getattr(env, "state_keys", None)
    return np.asarray(fn() if callable(fn) else text_state_keys(obs), dtype=np.uint64).view(np.int64).tolist()


def _split_stop(tokenizer: Any, result: GenerationResult, stop_ids: set[int]) -> tuple[list[int], str]:
    """The sampled ids without a final stop token, and that token's text ("" when it stopped by length or by a stop
    string: the string's token is part of the answer text, and the template closes the message as after a length
    stop)."""
    ids = list(result.token_ids)
    if getattr(result, "stop_string", ""):
        return ids, ""
    if result.finish_reason == "stop" and ids and (not stop_ids or ids[-1] in stop_ids):
        return ids[:-1], _decode(tokenizer, ids[-1:], skip_special=False)
    return ids, ""


def _drop_prefix(text: str, prefix: str) -> str:
    return text[len(prefix) :] if prefix and text.startswith(prefix) else text


def _step_subset(env: Any, todo: dict[int, Any], render_kw: dict[str, Any]) -> tuple:
    """Step only the instances in ``todo`` (index -> action); the others must not change."""
    n = env.num_envs
    if env.action_space != "text":
        actions = np.zeros(n, dtype=np.int32)  # 0 = "no valid action": a no-op for every built-in env
        for i, a in todo.items():
            actions[i] = a
        return env.step(actions, **render_kw)
    actions = [todo.get(i, "") for i in range(n)]
    active = np.array([i in todo for i in range(n)], dtype=bool)
    return env.step(actions, active=active, **render_kw)


def _chat_sequence(
    tokenizer: Any,
    messages: list[dict[str, str]],
    contents: list[tuple[list[int], list[float], str] | None],
    enable_think: bool,
) -> tuple[list[int], list[int], list[float], list[int]]:
    """Tokenize an update-time chat in chunks, keeping the assistant turns' token spans.

    Args:
        messages: ``build_messages(..., for_update=True)`` output.
        contents: one entry per assistant message: ``(sampled_ids, logprobs, stop_text)`` to use the sampled ids
            for the content after the generation prefix (the prefix itself is template text), or None to
            re-tokenize the content text (canonical mode; the template's end-of-turn token after it is trained).
        enable_think: which generation prefix the sampled contents start with.

    Returns:
        ``(ids [T], mask [T], logprobs [T], turn_last [n_assistant])``: mask 1 on assistant tokens, turn_last the
        index of each assistant turn's last token.
    """
    full = render_chat(tokenizer, messages, enable_think, for_update=True)
    eos_text = getattr(tokenizer, "eos_token", None) or ""
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    turn_last: list[int] = []
    pos = 0
    assistant = [m for m, msg in enumerate(messages) if msg["role"] == "assistant"]
    if len(assistant) != len(contents):
        raise ValueError(f"{len(contents)} contents for {len(assistant)} assistant messages")

    def add(new: list[int], trained: int, lp: list[float] | None = None) -> None:
        ids.extend(new)
        mask.extend([trained] * len(new))
        logps.extend(lp if lp is not None else [0.0] * len(new))

    prefix = generation_prefix(enable_think)
    for m, content in zip(assistant, contents, strict=True):
        header = tokenizer.apply_chat_template(messages[:m], add_generation_prompt=True, tokenize=False)
        text = messages[m]["content"]
        if not full.startswith(header, 0) or full[len(header) : len(header) + len(text)] != text or pos > len(header):
            raise ValueError("the chat template does not render earlier messages verbatim; cannot locate turns")
        end = len(header) + len(text)
        if content is None:
            add(_encode(tokenizer, full[pos : len(header)]), 0)
            closing = eos_text if eos_text and full.startswith(eos_text, end) else ""
            add(_encode(tokenizer, text + closing), 1)
            pos = end + len(closing)
        else:
            sampled, lp, stop_text = content
            if not text.startswith(prefix):
                raise ValueError(f"a sampled assistant content must start with {prefix!r}")
            add(_encode(tokenizer, full[pos : len(header) + len(prefix)]), 0)
            add(list(sampled), 1, list(lp))
            pos = end + (len(stop_text) if stop_text and full.startswith(stop_text, end) else 0)
        turn_last.append(len(ids) - 1)
    add(_encode(tokenizer, full[pos:]), 0)
    return ids, mask, logps, turn_last


def _system_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the rendered system message (where RAGEN's ``turn_indicators`` reaches 2)."""
    return len(_encode(tokenizer, tokenizer.apply_chat_template(messages[:1], tokenize=False)))


def run_rollout(
    env: Any,
    engine: Engine,
    tokenizer: Any,
    spec: EnvPromptSpec,
    seeds: Sequence[int] | np.ndarray,
    group_ids: Sequence[int] | np.ndarray,
    cfg: RolloutConfig | None = None,
    sampling: SamplingParams | None = None,
    request_seeds: Sequence[int] | None = None,
) -> RolloutBatch:
    """Run one episode on every instance of ``env`` and build the training batch.

    Args:
        env: a ``fastpo.envs`` batch env with ``num_envs == len(seeds)``.
        engine: generation engine (sessions in KV mode, ``generate`` otherwise).
        tokenizer: Hugging Face tokenizer with a chat template.
        spec: prompt settings (``prompt_spec(env_name)``); its ``max_actions_per_traj`` is the episode budget.
        seeds: ``int[N]`` env seeds (recorded only with ``cfg.already_reset``).
        group_ids: ``int[N]`` group of each instance (same seed within a group).
        cfg: rollout options (default ``RolloutConfig()``).
        sampling: engine sampling params (``max_new_tokens`` = RAGEN's response_length).
        request_seeds: ``int[N]`` per-instance sampling seeds; turn t uses ``mix(request_seeds[i], t)``; None lets
            the engine draw.

    Returns:
        ``RolloutBatch`` with N trajectories in instance order and the batch metrics.
    """
    part = RolloutPart(env, spec, seeds, group_ids, cfg or RolloutConfig(), request_seeds)
    return run_rollouts([part], engine, tokenizer, sampling)[0]


@dataclass
class RolloutPart:
    """One env's share of a multi-env rollout (``run_rollouts``): the arguments of ``run_rollout`` that differ per
    env. ``cfg`` None = ``RolloutConfig()``."""

    env: Any
    spec: EnvPromptSpec
    seeds: Sequence[int] | np.ndarray
    group_ids: Sequence[int] | np.ndarray
    cfg: RolloutConfig | None = None
    request_seeds: Sequence[int] | None = None


def run_rollouts(
    parts: Sequence[RolloutPart], engine: Engine, tokenizer: Any, sampling: SamplingParams | None = None
) -> list[RolloutBatch]:
    """``run_rollout`` for several envs at once, generating each turn for ALL their active instances in one engine
    call (one decode loop instead of one per env; e.g. Countdown and Bandit groups in one iteration). Each part's
    trajectories are those ``run_rollout`` gives for it alone (every request's draws depend only on its own seed
    and context; the built-in engine up to float differences from the batch's padding). A turn's generation time
    is shared among the parts in proportion to their requests. Returns one ``RolloutBatch`` per part, in order."""
    sampling = sampling or SamplingParams()
    runs: list[_PartRun] = []
    try:
        for part in parts:
            runs.append(_PartRun(part, engine, tokenizer, sampling))
        for turn in range(max((r.cfg.max_turns for r in runs), default=0)):
            todo = [r.prepare(turn) for r in runs]
            if not any(todo):
                break
            t0 = time.perf_counter()
            results: dict[int, list[GenerationResult]] = {}
            for kv in (True, False):  # one call per generation mode present this turn
                calls = [k for k, r in enumerate(runs) if todo[k] and r.kv == kv]
                if not calls:
                    continue
                pending = [p for k in calls for p in runs[k].pending]
                seeded = [runs[k].rseeds is not None for k in calls]
                if any(seeded) and not all(seeded):
                    raise ValueError("give request_seeds to every RolloutPart or to none (one engine call draws all)")
                rseeds = [s for k in calls for s in runs[k].rseeds] if all(seeded) else None
                if kv:
                    sids = [runs[k].sessions[i] for k in calls for i in todo[k]]
                    engine.extend(sids, pending)
                    out = engine.generate_sessions(sids, sampling, rseeds)
                else:
                    out = engine.generate(pending, sampling, rseeds)
                for k in calls:
                    results[k], out = out[: len(todo[k])], out[len(todo[k]) :]
            spent, total = time.perf_counter() - t0, sum(len(t) for t in todo)
            for k, r in enumerate(runs):
                if todo[k]:
                    r.timings["generate_s"] += spent * len(todo[k]) / total
                    r.absorb(turn, todo[k], results[k])
        return [r.finish() for r in runs]
    finally:
        for r in runs:
            r.close()


class _PartRun:
    """The state of one env's episodes during ``run_rollouts``: prepare a turn's prompts, absorb its generations
    (parse, step the env, next observation), build the batch at the end."""

    def __init__(self, part: RolloutPart, engine: Engine, tokenizer: Any, sampling: SamplingParams):
        cfg = part.cfg or RolloutConfig()
        env, spec = part.env, part.spec
        n = env.num_envs
        seeds = [int(s) for s in np.asarray(part.seeds).reshape(-1)]
        groups = [int(g) for g in np.asarray(part.group_ids).reshape(-1)]
        if len(seeds) != n or len(groups) != n:
            raise ValueError(f"need {n} seeds and group ids (env.num_envs), got {len(seeds)} and {len(groups)}")
        if part.request_seeds is not None and len(part.request_seeds) != n:
            raise ValueError(f"need {n} request seeds or None, got {len(part.request_seeds)}")
        self.env, self.spec, self.cfg, self.engine, self.tokenizer = env, spec, cfg, engine, tokenizer
        self.sampling, self.request_seeds = sampling, part.request_seeds
        self.think = spec.enable_think
        self.per_turn = cfg.max_actions_per_turn or int(getattr(env, "max_actions_per_turn", 5))
        self.budget = spec.max_actions_per_traj
        self.discrete = env.action_space != "text"
        names = list(env.action_names) if self.discrete else list(getattr(env, "action_vocabulary", None) or [])
        self.names = names
        self.render_kw = {"render": False} if "render" in inspect.signature(env.step).parameters else {}
        self.kv = cfg.max_context_window <= 0 and not cfg.canonical
        self.stop_ids = set(sampling.stop_token_ids) | set(getattr(engine, "eos_token_ids", ()) or ())
        self.window = cfg.max_context_window if cfg.max_context_window > 0 else -1
        self.timings = {"generate_s": 0.0, "env_s": 0.0, "prompt_s": 0.0}
        self.pending: list[list[int]] = []
        self.rseeds: list[int] | None = None
        self.sessions: list[int] = []
        t0 = time.perf_counter()
        obs = env.render() if cfg.already_reset else env.reset(np.asarray(seeds, dtype=np.int64))
        keys = _state_keys(env, obs)
        self.timings["env_s"] += time.perf_counter() - t0
        self.eps = [
            _Episode(seed=seeds[i], group=groups[i], turns=[Turn(obs[i], actions_left=self.budget)],
                     state_keys=[keys[i]]) for i in range(n)
        ]
        self.sessions = engine.open_sessions(n) if self.kv else []

    def prepare(self, turn: int) -> list[int]:
        """The instances that generate at this turn (only what fits the context cap); sets ``pending`` (their new
        token ids) and ``rseeds``."""
        if turn >= self.cfg.max_turns:
            return []
        t0 = time.perf_counter()
        tok, sampling = self.tokenizer, self.sampling
        todo: list[int] = []
        self.pending = []
        for i, ep in enumerate(self.eps):
            if not ep.active:
                continue
            text = render_chat(tok, build_messages(self.spec, ep.turns, self.window), self.think)
            if self.kv:
                if not text.startswith(ep.text):
                    raise ValueError("the chat template re-renders earlier turns differently; use canonical=True")
                new = _encode(tok, _drop_prefix(text[len(ep.text) :], ep.stop_text))
                length = ep.context_len + len(new)
            else:
                new = _encode(tok, text)
                length = len(new)
            if length + sampling.max_new_tokens > self.cfg.max_model_len:
                ep.active, ep.context_truncated = False, True
                continue
            todo.append(i)
            self.pending.append(new)
            ep.text = text
            ep.context_len = length
        self.rseeds = None
        if self.request_seeds is not None:
            self.rseeds = [(int(self.request_seeds[i]) * 1_000_003 + turn) % (1 << 63) for i in todo]
        self.timings["prompt_s"] += time.perf_counter() - t0
        return todo

    def absorb(self, turn: int, todo: list[int], results: list[GenerationResult]) -> None:
        """Parse this turn's generations, execute the actions one at a time, render the next observation."""
        cfg, tok, think, eps, env = self.cfg, self.tokenizer, self.think, self.eps, self.env
        plans: dict[int, list] = {}
        for i, res in zip(todo, results, strict=True):
            ep = eps[i]
            resp = parse_generation(_decode(tok, res.token_ids, skip_special=True), think)
            acts = parse_actions(resp.answer, self.names or None, self.spec.action_sep, self.per_turn)
            chosen = acts.ids if self.discrete else acts.names
            penalty = cfg.format_penalty if (not acts.names or not acts.all_valid) else 0.0
            if cfg.count_truncated_penalty and not acts.raw_all_valid:
                penalty = cfg.format_penalty
            ep.samples.append(res)
            ep.penalties.append(float(penalty))
            ep.canonical.append(canonical_response(resp, acts, think))
            plans[i] = chosen[: max(0, self.budget - ep.actions_used)]
            sampled, ep.stop_text = _split_stop(tok, res, self.stop_ids)
            ep.stop_texts.append(ep.stop_text)
            ep.context_len += len(res.token_ids)
            if self.kv:
                ep.text += _decode(tok, sampled, skip_special=False)
                ep.turns[-1].response = generation_prefix(think) + _decode(tok, sampled, False)
            elif cfg.canonical:
                ep.turns[-1].response = ep.canonical[-1]
            else:
                ep.turns[-1].response = generation_prefix(think) + _decode(tok, sampled, False)
        # -- execute actions one at a time ------------------------------------------------------------------------
        t0 = time.perf_counter()
        rewards: dict[int, list[float]] = {i: [] for i in todo}
        flags: dict[int, tuple[float, float]] = {}
        stopped: set[int] = set()
        for k in range(max((len(p) for p in plans.values()), default=0)):
            step = {i: p[k] for i, p in plans.items() if len(p) > k and i not in stopped}
            if not step:
                break
            _, reward, terminated, truncated, info = _step_subset(env, step, self.render_kw)
            for i in step:
                rewards[i].append(float(reward[i]))
                valid, effective = bool(info["action_is_valid"][i]), bool(info["action_is_effective"][i])
                eps[i].num_valid += valid
                eps[i].num_effective += effective
                eps[i].success = bool(info["success"][i])
                flags[i] = (float(valid), float(effective))
                if terminated[i] or truncated[i]:
                    stopped.add(i)
        obs = env.render()
        keys = _state_keys(env, obs)
        self.timings["env_s"] += time.perf_counter() - t0
        # -- bookkeeping, next observation ------------------------------------------------------------------------
        for i in todo:
            ep = eps[i]
            ep.actions_used += len(rewards[i])
            ep.turns[-1].reward = turn_reward(rewards[i])
            ep.last_valid.append(flags.get(i, (0.0, 0.0))[0])
            ep.last_effective.append(flags.get(i, (0.0, 0.0))[1])
            ep.env_done = i in stopped
            ep.turns.append(Turn(obs[i], actions_left=self.budget - ep.actions_used))
            ep.state_keys.append(keys[i])
            if ep.env_done or ep.actions_used >= self.budget or turn + 1 >= cfg.max_turns:
                ep.active = False

    def finish(self) -> RolloutBatch:
        t0 = time.perf_counter()
        trajectories = [_finish(ep, self.tokenizer, self.spec, self.cfg, self.kv) for ep in self.eps]
        self.timings["prompt_s"] += time.perf_counter() - t0
        env = self.env
        label = self.cfg.env_label or ENV_LABELS.get(getattr(env, "name", ""), getattr(env, "name", "") or "env")
        return RolloutBatch(trajectories, _metrics(self.eps, trajectories, self.timings, label,
                                                   self.cfg.env_metric_prefix))

    def close(self) -> None:
        if self.sessions:
            self.engine.close_sessions(self.sessions)
            self.sessions = []


def _finish(ep: _Episode, tokenizer: Any, spec: EnvPromptSpec, cfg: RolloutConfig, kv: bool) -> Trajectory:
    """Build the training sequence, mask and rewards of one finished episode."""
    think = spec.enable_think
    window = cfg.max_context_window if cfg.max_context_window > 0 else -1
    messages = build_messages(spec, ep.turns, window, for_update=True)
    num_turns = len(ep.samples)
    kept = min(num_turns, window) if window > 0 else num_turns
    first = num_turns - kept  # index of the first generated turn in the sequence
    contents: list[tuple[list[int], list[float], str] | None] = []
    for res, stop_text in zip(ep.samples[first:], ep.stop_texts[first:], strict=True):
        if cfg.canonical:
            contents.append(None)
        else:
            contents.append((list(res.token_ids), list(res.logprobs), stop_text))
    ids, mask, logps, turn_last = _chat_sequence(tokenizer, messages, contents, think)
    exact = not cfg.canonical and (window <= 0 or num_turns <= window)
    if not exact:
        logps = [0.0] * len(ids)
    if cfg.train_on_observations and num_turns:
        start = _system_len(tokenizer, messages) + 1
        mask = [1 if j >= start else m for j, m in enumerate(mask)]
    turn_end = [0] * len(ids)
    for j in turn_last:
        turn_end[j] = 1
    turn_values = [float(t.reward) for t in ep.turns[:num_turns]]
    counted = range(first, num_turns) if window > 0 and cfg.window_reward == "window" else range(num_turns)
    rewards = [0.0] * len(ids)
    if num_turns:
        if cfg.use_turn_scores:
            for pos, k in zip(turn_last, range(first, num_turns), strict=True):
                rewards[pos] += turn_values[k] + (ep.penalties[k] if cfg.turn_level_penalties else 0.0)
        else:
            last = max(j for j, m in enumerate(mask) if m)
            rewards[last] += sum(turn_values[k] for k in counted) + sum(ep.penalties)
    return Trajectory(
        group=ep.group,
        seed=ep.seed,
        input_ids=ids,
        loss_mask=mask,
        sample_logprobs=logps,
        token_rewards=rewards,
        turn_end=turn_end,
        reward=float(sum(rewards)),
        success=ep.success,
        num_turns=num_turns,
        num_actions=ep.actions_used,
        num_valid_actions=ep.num_valid,
        num_effective_actions=ep.num_effective,
        num_format_penalties=sum(1 for p in ep.penalties if p != 0.0),
        finish_reasons=[r.finish_reason for r in ep.samples],
        response_lengths=[len(r.token_ids) for r in ep.samples],
        turn_rewards=turn_values,
        turn_penalties=list(ep.penalties),
        turn_state_keys=ep.state_keys[:num_turns],
        logprobs_exact=exact,
        env_done=ep.env_done,
        context_truncated=ep.context_truncated,
        messages=messages,
    )


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _metrics(
    eps: list[_Episode], trajs: list[Trajectory], timings: dict[str, float], label: str, prefix: str
) -> dict[str, float]:
    """Batch metrics (docs/SEMANTICS.md sections 7-8). ``action_is_valid`` / ``action_is_effective`` follow RAGEN's
    ``get_rollout_states``: per trajectory, the flags of each turn's LAST executed action summed over turns and
    divided by the number of turns (a turn without an executed action counts 0), then averaged over
    trajectories. ``in_group_std``: unbiased std of ``Trajectory.reward`` per group (0 for a group of one),
    averaged over groups. ``pass@G``: fraction of groups with at least one success (G = the largest group)."""
    by_group: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_group[t.group].append(t)
    group_size = max((len(v) for v in by_group.values()), default=0)
    stds = [float(np.std([t.reward for t in v], ddof=1)) if len(v) > 1 else 0.0 for v in by_group.values()]
    pass_at = _mean([float(any(t.success for t in v)) for v in by_group.values()])
    valid = [sum(e.last_valid) / len(e.last_valid) if e.last_valid else 0.0 for e in eps]
    effective = [sum(e.last_effective) / len(e.last_effective) if e.last_effective else 0.0 for e in eps]
    lengths = [n for t in trajs for n in t.response_lengths]
    turns_total = max(1, sum(t.num_turns for t in trajs))
    actions_total = max(1, sum(t.num_actions for t in trajs))
    per_env = {
        "success": _mean([float(t.success) for t in trajs]),
        "action_is_valid": _mean(valid),
        "action_is_effective": _mean(effective),
        "num_actions": _mean([t.num_actions for t in trajs]),
        f"pass@{group_size}": pass_at,
    }
    metrics = {f"rollout/{k}": v for k, v in per_env.items()}
    metrics.update({f"{prefix}/{label}/{k}": v for k, v in per_env.items()})
    metrics.update(
        {
            "rollout/reward": _mean([t.reward for t in trajs]),
            "rollout/reward_std": float(np.std([t.reward for t in trajs])) if trajs else 0.0,
            "rollout/in_group_std": _mean(stds),
            "rollout/num_turns": _mean([t.num_turns for t in trajs]),
            "rollout/valid_action_rate": sum(t.num_valid_actions for t in trajs) / actions_total,
            "rollout/effective_action_rate": sum(t.num_effective_actions for t in trajs) / actions_total,
            "rollout/format_penalty_rate": sum(t.num_format_penalties for t in trajs) / turns_total,
            "rollout/response_length": _mean(lengths),
            "rollout/response_length_max": float(max(lengths, default=0)),
            "rollout/length_stop_rate": sum(r == "length" for t in trajs for r in t.finish_reasons) / turns_total,
            "rollout/context_truncated": _mean([float(t.context_truncated) for t in trajs]),
            "rollout/seq_len": _mean([len(t.input_ids) for t in trajs]),
            "rollout/seq_len_max": float(max((len(t.input_ids) for t in trajs), default=0)),
            "rollout/trained_tokens": float(sum(sum(t.loss_mask) for t in trajs)),
        }
    )
    metrics.update({f"rollout/{k}": v for k, v in timings.items()})
    metrics.update({f"{prefix}/{label}/{k}": v for k, v in timings.items() if k != "prompt_s"})
    assert all(math.isfinite(v) for v in metrics.values())
    return metrics
