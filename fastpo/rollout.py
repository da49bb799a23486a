"""The multi-turn rollout: prompts -> batched generation -> parsing -> env steps -> training sequences.

    part = RolloutPart(env, prompt_spec("sokoban"), seeds, group_ids, request_seeds, max_turns=5, label="Sokoban")
    batch = run_rollouts([part], engine, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=400), cfg)[0]
    batch.trajectories[i].input_ids / loss_mask / sample_logprobs / token_rewards / turn_end   # each [T_i]
    batch.metrics["rollout/in_group_std"], batch.metrics["env/Sokoban/success"], ...

One chat per env instance (``fastpo.prompts``: RAGEN's text, character-exact). Each turn is ONE batched engine call
for every active instance of every part; the sampled text is parsed (``fastpo.parsing``), the valid actions run one
at a time (per-turn cap, per-episode budget ``spec.max_actions_per_traj``, stop at the first done) and the env
renders once. An episode ends when the env is done, the budget is spent, ``max_turns`` turns were generated, or
the next prompt would not fit ``cfg.max_model_len``. ``cfg`` is the trainer's ``fastpo.config.RolloutConfig``.

Generation modes: KV reuse (default): one engine session per instance, only each turn's new suffix is tokenized,
the training sequence is the session's tokens (sample logprobs exact). ``cfg.canonical`` (RAGEN's mode): the
history holds RAGEN's canonical rewrites, re-tokenized in full each turn (``logprobs_exact=False``).
``cfg.max_context_window = k > 0``: prompts and the training sequence keep the last k turns (RAGEN's
``get_lm_inputs`` / ``prepare_for_update``; logprobs exact only for episodes of <= k turns).
``cfg.context_window_mode`` limited_multi_turn / single_turn (RAGEN-2): each turn's prompt is
``prompts.turn_messages``, generated afresh (no KV reuse), and each turn is its own training sequence (the prompt
ids it was given, then its sampled tokens), stored back to back in the episode's Trajectory (``sample_bounds``).

Loss mask: the model's own sampled tokens (and the stop token that ended a turn); ``cfg.train_on_observations``
also every token after the system message (RAGEN ``enable_response_mask: False``). Rewards: ``sum(turn rewards)
+ sum(format penalties)`` on the last trained token, or with ``cfg.reward_level == "turn"`` each turn's reward on
its last token (penalties dropped as in RAGEN unless ``cfg.turn_level_penalties``). ``turn_end`` marks each
assistant turn's last token (bi-level GAE, GiGPO).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chat_tokens import TextCache, chat_sequence, encode, prompt_text, system_len
from .config import RolloutConfig
from .engine.base import Engine, GenerationResult, SamplingParams, as_async
from .envs.base import text_state_keys
from .parsing import canonical_response, generation_prefix, parse_actions, parse_generation
from .prompts import EnvPromptSpec, Turn, build_messages, turn_messages, turn_reward
from .rollout_metrics import batch_metrics
from .trajectory import Trajectory, turn_data

#: Metric labels of the built-in envs (``env/<label>/...``), RAGEN's tags.
ENV_LABELS = {"sokoban": "Sokoban", "frozenlake": "FrozenLake", "bandit": "Bandit", "countdown": "Countdown"}
ENV_LABELS.update(qa="MetamathQA", metamathqa="MetamathQA")


def env_label(name: str) -> str:
    """Metric label of a configured env name: ``ENV_LABELS`` (RAGEN's tags of the base names), else the name in
    CamelCase (bandit_test -> BanditTest, larger_sokoban -> LargerSokoban, as RAGEN tags them), so two variants of
    one env class (validation on bandit and bandit_test) are reported apart, not averaged together."""
    return ENV_LABELS.get(name) or "".join(part[:1].upper() + part[1:] for part in name.split("_"))


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
    # per generated turn: the engine's weight version (an int [n] per token for a turn split by an interruption)
    versions: list[Any] = field(default_factory=list)
    # per-turn context modes: the prompt ids of the turn being generated; per generated turn, the ids it was given
    prompt_ids: list[int] = field(default_factory=list)
    turn_prompts: list[list[int]] = field(default_factory=list)


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
    **part: Any,
) -> RolloutBatch:
    """Run one episode on every instance of ``env`` and build the training batch.

    Args:
        env: a ``fastpo.envs`` batch env with ``num_envs == len(seeds)``.
        engine: generation engine (sessions in KV mode, ``generate`` otherwise).
        tokenizer: Hugging Face tokenizer with a chat template.
        spec: prompt settings (``prompt_spec(env_name)``); its ``max_actions_per_traj`` is the episode budget.
        seeds: ``int[N]`` env seeds (recorded only with ``already_reset``).
        group_ids: ``int[N]`` group of each instance (same seed within a group).
        cfg: the trajectory options (``fastpo.config.RolloutConfig``; its defaults when None).
        sampling: engine sampling params (``max_new_tokens`` = RAGEN's response_length).
        request_seeds: ``int[N]`` per-instance sampling seeds; turn t uses ``mix(request_seeds[i], t)``; None lets
            the engine draw.
        part: the per-env options of :class:`RolloutPart` (max_turns, max_actions_per_turn, label, prefix,
            already_reset).

    Returns:
        ``RolloutBatch`` with N trajectories in instance order and the batch metrics.
    """
    return run_rollouts([RolloutPart(env, spec, seeds, group_ids, request_seeds, **part)], engine, tokenizer,
                        sampling, cfg)[0]


@dataclass
class RolloutPart:
    """One env's share of a rollout (``run_rollouts``): its batch env, prompts, instances and per-env budgets."""

    env: Any
    spec: EnvPromptSpec
    seeds: Sequence[int] | np.ndarray
    group_ids: Sequence[int] | np.ndarray
    request_seeds: Sequence[int] | None = None
    max_turns: int = 5
    """Turns generated per episode at most [max_turn]."""
    max_actions_per_turn: int | None = None
    """Actions kept per answer [max_actions_per_turn]; None: the env's own. The episode budget is
    ``spec.max_actions_per_traj`` (the number the prompt shows)."""
    label: str | None = None
    """Name in the ``<prefix>/<label>/...`` metrics; None: ``env_label`` of ``env.name``."""
    prefix: str = "env"
    """Prefix of the per-env metrics ("val-env" for validation)."""
    already_reset: bool = False
    """The caller reset the env (e.g. ``reset_from_layouts``): start from ``env.render()``."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_actions_per_turn is not None and self.max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1 or None, got {self.max_actions_per_turn}")


def mix_seed(request_seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of the instance whose request seed is `request_seed` (int63)."""
    return (int(request_seed) * SEED_MIX + turn) % (1 << 63)


#: The multiplier of :func:`mix_seed`: a prime above any turn count (turns are few, max_turns is small), so
#: request_seed * SEED_MIX + turn is a different engine seed for every (request seed, turn) pair (below 2**63 the
#: pair is recovered by divmod, as ``fastpo.testing.ScriptedEngine`` does), and neighbouring request seeds land far
#: apart. Every sampling seed of every run depends on it: never change it.
SEED_MIX = 1_000_003


def run_rollouts(
    parts: Sequence[RolloutPart], engine: Engine, tokenizer: Any, sampling: SamplingParams | None = None,
    cfg: RolloutConfig | None = None,
) -> list[RolloutBatch]:
    """``run_rollout`` for several envs at once. Each part's trajectories are those ``run_rollout`` gives for it
    alone (every request's draws depend only on its own seed and context; the built-in engine up to float
    differences of batched matmuls). Returns one ``RolloutBatch`` per part, in order.

    ``cfg.mode`` picks the driver. lockstep: each turn is ONE engine call for every active instance of every part
    (turn t + 1 starts when the slowest row of turn t stopped; RAGEN's loop). async: no turn barrier; each episode
    submits its next turn the moment its previous one completed and its env stepped (``engine.submit`` /
    ``engine.step``), the env steps of the instances whose turns completed at the same engine step are grouped into
    one batch-env call, and at most ``cfg.max_num_seqs`` episodes are in flight (0 = all). Both give the same
    trajectories for the same seeds."""
    sampling, cfg = sampling or SamplingParams(), cfg or RolloutConfig()
    if cfg.max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {cfg.max_model_len}")
    runs: list[_PartRun] = []
    stats = getattr(engine, "stats", None)
    before = dataclasses.replace(stats) if stats is not None else None
    try:
        for part in parts:
            runs.append(_PartRun(part, cfg, engine, tokenizer, sampling))
        if cfg.mode == "async":
            engine = as_async(engine)
            _drive_async(runs, engine, cfg.max_num_seqs)
        else:
            _drive_lockstep(runs, engine, sampling)
        batches = [r.finish() for r in runs]
    except BaseException:
        if cfg.mode == "async":
            engine.abort()  # a failed iteration leaves no request behind for the next one
        raise
    finally:
        for r in runs:
            r.close()
    if before is not None:
        spent = engine.stats.since(before)
        for batch in batches:
            batch.metrics["rollout/decode_occupancy"] = spent.occupancy()
            batch.metrics["rollout/slot_occupancy"] = spent.slot_occupancy()
            batch.metrics["rollout/prefill_s"] = spent.prefill_s
            batch.metrics["rollout/decode_s"] = spent.decode_s
    return batches


def _drive_lockstep(runs: list[_PartRun], engine: Engine, sampling: SamplingParams) -> None:
    """One engine call per turn for every active instance of every part (one per generation mode present)."""
    for _ in range(max((r.part.max_turns for r in runs), default=0)):
        todo = [r.prepare() for r in runs]
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
                r.absorb(todo[k], results[k])
                r.release(todo[k])


def _drive_async(runs: list[_PartRun], engine: Engine, max_in_flight: int) -> None:
    """The barrier-free driver (see ``run_rollouts``). An episode in flight holds one engine session: its KV session
    in KV mode, else a one-request session re-opened with the full prompt every turn. Engine time is shared among
    the parts in proportion to their requests in flight at each step."""
    seeded = [r.request_seeds is not None for r in runs]
    if any(seeded) and not all(seeded):
        raise ValueError("give request_seeds to every RolloutPart or to none")
    waiting = [(k, i) for k, r in enumerate(runs) for i in range(len(r.eps))]  # episodes not started yet
    waiting.reverse()  # pop() takes them in instance order
    in_flight = [0] * len(runs)
    temp: dict[tuple[int, int], int] = {}  # non-KV requests: (part, instance) -> the session opened for it

    def submit(k: int, todo: list[int]) -> None:
        runs[k].submit(engine, k, todo, temp)
        in_flight[k] += len(todo)

    def start_more() -> None:
        while waiting and (max_in_flight <= 0 or sum(in_flight) < max_in_flight):
            k, i = waiting.pop()
            first = runs[k].prepare([i])
            runs[k].release([i])  # no first turn fits the context cap
            submit(k, first)

    try:
        start_more()
        while engine.num_unfinished():
            t0 = time.perf_counter()
            done = engine.step()
            spent, busy = time.perf_counter() - t0, max(sum(in_flight), 1)
            for k, r in enumerate(runs):
                r.timings["generate_s"] += spent * in_flight[k] / busy
            finished: dict[int, list] = {}
            for c in done:
                k, i = c.tag
                finished.setdefault(k, []).append((i, c.result))
                in_flight[k] -= 1
                if (k, i) in temp:
                    engine.close_sessions([temp.pop((k, i))])
            for k, items in sorted(finished.items()):  # one batch-env step for the instances that completed together
                todo = [i for i, _ in items]
                runs[k].absorb(todo, [res for _, res in items])
                following = runs[k].prepare(todo)
                runs[k].release(todo)  # episodes that ended (done, budget, turn or context cap)
                submit(k, following)
            start_more()
    finally:
        for sid in temp.values():
            engine.close_sessions([sid])


class _PartRun:
    """The state of one env's episodes during ``run_rollouts``: prepare a turn's prompts, absorb its generations
    (parse, step the env, next observation), build the batch at the end."""

    def __init__(self, part: RolloutPart, cfg: RolloutConfig, engine: Engine, tokenizer: Any, sampling: SamplingParams,
                 start: bool = True):
        env, spec = part.env, part.spec
        n = env.num_envs
        seeds = [int(s) for s in np.asarray(part.seeds).reshape(-1)]
        groups = [int(g) for g in np.asarray(part.group_ids).reshape(-1)]
        if len(seeds) != n or len(groups) != n:
            raise ValueError(f"need {n} seeds and group ids (env.num_envs), got {len(seeds)} and {len(groups)}")
        if part.request_seeds is not None and len(part.request_seeds) != n:
            raise ValueError(f"need {n} request seeds or None, got {len(part.request_seeds)}")
        self.env, self.spec, self.cfg, self.part, self.engine = env, spec, cfg, part, engine
        self.tokenizer, self.sampling = tokenizer, sampling
        self.think = spec.enable_think
        self.per_turn = part.max_actions_per_turn or int(getattr(env, "max_actions_per_turn", 5))
        self.budget = spec.max_actions_per_traj
        self.discrete = env.action_space != "text"
        names = list(env.action_names) if self.discrete else list(getattr(env, "action_vocabulary", None) or [])
        self.names = names
        self.render_kw = {"render": False} if "render" in inspect.signature(env.step).parameters else {}
        self.mode = cfg.context_window_mode
        # a windowed or per-turn prompt does not extend the previous turn's context: every turn is prefilled afresh
        self.kv = cfg.max_context_window <= 0 and not cfg.canonical and self.mode == "full"
        self.stop_ids = set(sampling.stop_token_ids) | set(getattr(engine, "eos_token_ids", ()) or ())
        self.window = cfg.max_context_window if cfg.max_context_window > 0 else -1
        self.timings = {"generate_s": 0.0, "env_s": 0.0, "prompt_s": 0.0}
        self.pending: list[list[int]] = []
        self.cache = TextCache()  # the prompts rendered and encoded since the last batch
        self.rseeds: list[int] | None = None
        self.request_seeds = None if part.request_seeds is None else [int(x) for x in part.request_seeds]
        self.version = int(getattr(engine, "weight_version", 0))  # recorded on every turn absorbed
        self.eps = [_Episode(seed=0, group=-1, turns=[], active=False) for _ in range(n)]  # idle instances
        self.sessions, self.closed = [-1] * n if self.kv else [], set()
        if start:
            self.start(range(n), seeds, groups, already_reset=part.already_reset)

    def start(self, indices: Sequence[int], seeds: Sequence[int], groups: Sequence[int],
              request_seeds: Sequence[int] | None = None, already_reset: bool = False) -> None:
        """Begin new episodes on the instances `indices` (env seeds, group ids and, when given, request seeds one
        per index); the other instances keep their state. KV mode: each gets a fresh engine session."""
        indices = list(indices)
        env, n = self.env, self.env.num_envs
        t0 = time.perf_counter()
        if already_reset:
            obs = env.render()
        elif len(indices) == n and indices == list(range(n)):
            obs = env.reset(np.asarray(seeds, dtype=np.int64))
        else:
            full, mask = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
            full[indices], mask[indices] = seeds, True
            obs = env.reset(full, mask)
        keys = _state_keys(env, obs)
        self.timings["env_s"] += time.perf_counter() - t0
        for j, i in enumerate(indices):
            self.eps[i] = _Episode(seed=int(seeds[j]), group=int(groups[j]),
                                   turns=[Turn(obs[i], actions_left=self.budget)], state_keys=[keys[i]])
            if request_seeds is not None:
                self.request_seeds[i] = int(request_seeds[j])
        if self.kv:
            self.release([i for i in indices if self.sessions[i] >= 0], force=True)
            for i, sid in zip(indices, self.engine.open_sessions(len(indices)), strict=True):
                self.sessions[i] = sid

    def prepare(self, candidates: Sequence[int] | None = None) -> list[int]:
        """The instances among `candidates` (default: all) that generate their next turn now: active, under their
        turn cap, and with a prompt that fits the context cap. Sets ``pending`` (their new token ids) and ``rseeds``
        (turn t of instance i draws with ``mix(request_seeds[i], t)``: the same in lock-step and async rollouts)."""
        t0 = time.perf_counter()
        tok, sampling = self.tokenizer, self.sampling
        todo: list[int] = []
        self.pending = []
        for i in range(len(self.eps)) if candidates is None else candidates:
            ep = self.eps[i]
            if not ep.active:
                continue
            if len(ep.samples) >= self.part.max_turns:
                ep.active = False
                continue
            if self.mode == "full":
                messages = build_messages(self.spec, ep.turns, self.window)
            else:
                messages = turn_messages(self.spec, ep.turns, self.mode, self.cfg.max_context_window)
            text = prompt_text(tok, messages, self.think, self.cache)
            if self.kv:
                if not text.startswith(ep.text):
                    raise ValueError("the chat template re-renders earlier turns differently; use canonical=True")
                new = encode(tok, _drop_prefix(text[len(ep.text) :], ep.stop_text), self.cache)
                length = ep.context_len + len(new)
            else:
                new = encode(tok, text, self.cache)
                length = len(new)
            if length + sampling.max_new_tokens > self.cfg.max_model_len:
                ep.active, ep.context_truncated = False, True
                continue
            todo.append(i)
            self.pending.append(new)
            ep.text = text
            ep.prompt_ids = new if self.mode != "full" else []  # a per-turn training sequence starts with it
            ep.context_len = length
        self.rseeds = None if self.request_seeds is None else [self._turn_seed(i) for i in todo]
        self.timings["prompt_s"] += time.perf_counter() - t0
        return todo

    def absorb(self, todo: list[int], results: list[GenerationResult]) -> None:
        """Parse the generations of the instances in `todo` (each at its own turn), execute their actions one at a
        time, render the next observations. Instances outside `todo` are not stepped."""
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
            ep.turn_prompts.append(ep.prompt_ids)
            # one version per turn, or per token when the turn was interrupted and continued across a push
            split = getattr(res, "token_versions", None)
            ep.versions.append(self.version if split is None else np.asarray(split))
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
            if ep.env_done or ep.actions_used >= self.budget or len(ep.samples) >= self.part.max_turns:
                ep.active = False

    def finish(self, indices: Sequence[int] | None = None) -> RolloutBatch:
        """The batch of the episodes `indices` (default: every instance), in that order."""
        t0 = time.perf_counter()
        eps = self.eps if indices is None else [self.eps[i] for i in indices]
        trajectories = [_finish(ep, self.tokenizer, self.spec, self.cfg, self.kv, self.cache) for ep in eps]
        self.cache = TextCache()  # a pool's run lives across iterations: its texts are kept for one batch only
        self.timings["prompt_s"] += time.perf_counter() - t0
        env = self.env
        label = self.part.label or ENV_LABELS.get(getattr(env, "name", ""), getattr(env, "name", "") or "env")
        return RolloutBatch(trajectories, batch_metrics(eps, trajectories, self.timings, label, self.part.prefix))

    def release(self, indices: Sequence[int], force: bool = False) -> None:
        """Close the engine sessions of finished episodes among `indices` (their training sequences are built from
        the episode's own record): their KV memory is free for the episodes still running. ``force``: close them
        whether or not the episode finished (its instance starts a new one)."""
        done = [self.sessions[i] for i in indices if self.sessions and (force or not self.eps[i].active)
                and self.sessions[i] >= 0 and self.sessions[i] not in self.closed]
        if done:
            self.engine.close_sessions(done)
            self.closed.update(done)

    def submit(self, engine: Any, k: int, todo: Sequence[int], temp: dict[tuple[int, int], int]) -> None:
        """Queue the turns `todo` (just prepared: ``pending`` and ``rseeds`` are theirs) as requests to the driver's
        asynchronous `engine` (``as_async`` of this part's), tagged ``(k, i)``, k being this part's index in the
        driver. KV mode: on the episode's own session. Otherwise each request gets a one-request session, recorded
        in `temp` for the driver to close when it completes."""
        for j, i in enumerate(todo):
            if self.kv:
                sid = self.sessions[i]
            else:
                sid = temp[(k, i)] = engine.open_sessions(1)[0]
            if self.pending[j]:  # empty: a carried episode whose context the engine already holds
                engine.extend([sid], [self.pending[j]])
            engine.submit(sid, self.sampling, None if self.rseeds is None else self.rseeds[j], tag=(k, i))

    def resume(self, engine: Any, k: int, i: int, cut: GenerationResult) -> None:
        """Continue episode `i`'s turn that ``interrupt`` cut (KV mode only: the turn lives in the episode's session)
        with the turn's own request seed, tagged ``(k, i)`` as :meth:`submit` does."""
        if not self.kv:
            raise ValueError("an interrupted turn continues only in a context that grows turn by turn (KV mode)")
        seed = None if self.request_seeds is None else self._turn_seed(i)
        engine.submit(self.sessions[i], self.sampling, seed, tag=(k, i), resume=cut)

    def _turn_seed(self, i: int) -> int:
        """The request seed of instance `i`'s current turn t: ``mix(request_seeds[i], t)`` (the same in lock-step,
        async and a cut turn's continuation)."""
        return mix_seed(int(self.request_seeds[i]), len(self.eps[i].samples))

    def close(self) -> None:
        if self.sessions:
            self.engine.close_sessions([s for s in self.sessions if s >= 0 and s not in self.closed])
            self.sessions = []


def _finish(ep: _Episode, tokenizer: Any, spec: EnvPromptSpec, cfg: RolloutConfig, kv: bool,
            cache: TextCache | None = None) -> Trajectory:
    """Build the training sequence, mask and rewards of one finished episode (per-turn context modes:
    :func:`_finish_turns`). ``cache``: what the tokenizer already rendered and encoded."""
    if cfg.context_window_mode != "full":
        return _finish_turns(ep, tokenizer, spec, cfg, cache)
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
    ids, mask, logps, turn_last = chat_sequence(tokenizer, messages, contents, think, cache)
    versions = np.full(len(ids), -1, dtype=np.int32)
    for pos, k in zip(turn_last, range(first, num_turns), strict=True):  # each turn's trained run ends at pos
        start = pos
        while start > 0 and mask[start - 1]:
            start -= 1
        versions[start:pos + 1] = ep.versions[k]
    exact = not cfg.canonical and (window <= 0 or num_turns <= window)
    if not exact:
        logps = [0.0] * len(ids)
    if cfg.train_on_observations and num_turns:
        start = system_len(tokenizer, messages, cache) + 1
        mask = [1 if j >= start else m for j, m in enumerate(mask)]
    turn_end = [0] * len(ids)
    for j in turn_last:
        turn_end[j] = 1
    turn_values = [float(t.reward) for t in ep.turns[:num_turns]]
    counted = range(first, num_turns) if window > 0 and cfg.window_reward == "window" else range(num_turns)
    rewards = [0.0] * len(ids)
    if num_turns:
        if cfg.reward_level == "turn":
            for pos, k in zip(turn_last, range(first, num_turns), strict=True):
                rewards[pos] += turn_values[k] + (ep.penalties[k] if cfg.turn_level_penalties else 0.0)
        else:
            last = max(j for j, m in enumerate(mask) if m)
            rewards[last] += sum(turn_values[k] for k in counted) + sum(ep.penalties)
    step_keys, step_rewards = turn_data(turn_end, ep.state_keys[:num_turns], turn_values, ep.penalties)
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
        step_keys=step_keys,
        step_rewards=step_rewards,
        versions=versions,
    )


def _finish_turns(ep: _Episode, tokenizer: Any, spec: EnvPromptSpec, cfg: RolloutConfig,
                  cache: TextCache | None = None) -> Trajectory:
    """One finished episode under a per-turn context mode: its K per-turn training sequences back to back
    (``Trajectory.sample_bounds``). Sequence k is the prompt turn k was generated from, then its sampled tokens
    (the only trained ones, logprobs exact); with ``cfg.canonical`` the chat of ``turn_messages(...,
    with_response=True)`` re-tokenized, only its last assistant message trained. Each sequence holds the episode's
    return (turn rewards + format penalties) on its last trained token."""
    think, window = spec.enable_think, cfg.max_context_window
    num_turns = len(ep.samples)
    turn_values = [float(t.reward) for t in ep.turns[:num_turns]]
    ret = float(sum(turn_values) + sum(ep.penalties))
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    versions: list[int] = []
    rewards: list[float] = []
    turn_end: list[int] = []
    bounds = [0]
    messages: list[dict[str, str]] = []
    for k, res in enumerate(ep.samples):
        chat = turn_messages(spec, ep.turns[: k + 1], cfg.context_window_mode, window, with_response=True)
        messages += chat
        if cfg.canonical:
            n_assistant = sum(1 for m in chat if m["role"] == "assistant")
            s_ids, s_mask, _, last = chat_sequence(tokenizer, chat, [None] * n_assistant, think, cache)
            if len(last) > 1:  # earlier answers are context: only the last assistant message is trained
                s_mask = [0] * (last[-2] + 1) + s_mask[last[-2] + 1 :]
            end = last[-1]
            s_lp = [0.0] * len(s_ids)
        else:
            prompt, sampled = list(ep.turn_prompts[k]), list(res.token_ids)
            s_ids, s_mask = prompt + sampled, [0] * len(prompt) + [1] * len(sampled)
            s_lp = [0.0] * len(prompt) + list(res.logprobs)
            end = len(s_ids) - 1
        if not s_ids:
            raise ValueError(f"turn {k} of an episode has an empty training sequence")
        ends = [0] * len(s_ids)
        ends[end] = 1
        rew = [0.0] * len(s_ids)
        rew[max(j for j, m in enumerate(s_mask) if m) if any(s_mask) else end] = ret
        ids += s_ids
        mask += s_mask
        logps += s_lp
        versions += [ep.versions[k] if m else -1 for m in s_mask]  # per-turn contexts never cut a turn: one int
        rewards += rew
        turn_end += ends
        bounds.append(len(ids))
    step_keys, step_rewards = turn_data(turn_end, ep.state_keys[:num_turns], turn_values, ep.penalties)
    return Trajectory(
        group=ep.group, seed=ep.seed, input_ids=ids, loss_mask=mask, sample_logprobs=logps, token_rewards=rewards,
        turn_end=turn_end, reward=ret, success=ep.success, num_turns=num_turns, num_actions=ep.actions_used,
        num_valid_actions=ep.num_valid, num_effective_actions=ep.num_effective,
        num_format_penalties=sum(1 for p in ep.penalties if p != 0.0),
        finish_reasons=[r.finish_reason for r in ep.samples], response_lengths=[len(r.token_ids) for r in ep.samples],
        turn_rewards=turn_values, turn_penalties=list(ep.penalties), turn_state_keys=ep.state_keys[:num_turns],
        logprobs_exact=not cfg.canonical, env_done=ep.env_done, context_truncated=ep.context_truncated,
        messages=messages, step_keys=step_keys, step_rewards=step_rewards, versions=versions, sample_bounds=bounds)
