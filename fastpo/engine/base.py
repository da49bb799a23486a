"""The generation-engine interface that the built-in HF engine and the vLLM engine implement.

Two ways to generate:

    results = engine.generate(prompts, params, seeds)        # stateless: each prompt is a full list of token ids

    sids = engine.open_sessions(n)                           # multi-turn: the engine keeps each context
    engine.extend(sids, first_prompt_ids)                    # append tokens (the prompt, then each observation)
    results = engine.generate_sessions(sids, params, seeds)  # sample; the sampled ids are appended to the session
    engine.extend(sids, observation_ids)                     # e.g. "<|im_end|>\\n<|im_start|>user\\n..." tokens
    results = engine.generate_sessions(sids, params, seeds)
    engine.close_sessions(sids)

    engine.submit(sid, params, seed, tag)                    # asynchronous: queue one turn of one session
    for done in engine.step():                               # advance the running batch by one decode step
        done.session_id, done.tag, done.result               # each request as soon as it finished
    engine.num_unfinished()                                  # requests queued or running

The asynchronous interface is what the barrier-free rollout (``rollout.mode=async`` in ``fastpo.rollout``) drives:
a request's result is returned by the step at which it finished, so its episode can step its env and submit the
next turn while the other requests go on decoding. The built-in engine runs it with continuous batching (a
finished row frees its slot at once, a submitted row joins the running batch at the next step); an engine without
its own scheduler inherits the lock-step fallback of :class:`Engine` (one ``generate_sessions`` call over
everything queued).

What a result's logprobs are (both engines):
    ``logprobs[i] = log_softmax(logits_i / T)[token_ids[i]]`` over the FULL vocabulary, with ``T = temperature``
    (``T = 1`` for greedy). That is the quantity the trainer recomputes (``fused_linear_logprob(..., temperature=T)``),
    so the two can be compared token by token. It equals vLLM's ``logprobs_mode="processed_logprobs"`` with
    ``logprobs=0`` when top-k and top-p are off; with top-k / top-p on, vLLM renormalises over the kept tokens
    (its value is larger by ``-log(kept mass)``) while these stay unnormalised. ``raw_logprobs`` are the same
    under ``T = 1`` (vLLM's default ``raw_logprobs``). Top-k / top-p only decide which tokens can be drawn.

Seeds: ``seeds[i]`` fixes the random draws of request i in this call: the same seed, context and params give the
same tokens whatever else is in the batch (up to float differences from padding).
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

#: Temperatures below this sample greedily (vLLM's threshold).
GREEDY_EPS = 1e-5
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one call's requests (shared by all of them).

    Attributes:
        temperature: softmax temperature; < 1e-5 (e.g. 0) means greedy (argmax).
        top_p: nucleus sampling: draw only from the smallest set of tokens whose mass reaches top_p; 1 = off.
        top_k: draw only from the k most likely tokens; 0 or -1 = off.
        max_new_tokens: cap on the tokens sampled per request in this call (one turn for sessions).
        stop_token_ids: tokens that end a request (kept in the output), in addition to the model's EOS ids.
        ignore_eos: do not stop on the model's EOS ids (stop_token_ids still stop).
        stop: strings that end a request as soon as its generated text (decoded with special tokens kept) contains
            one; the token that completes the string is kept in the output (vLLM's ``include_stop_str_in_output``),
            so the sampled ids and their logprobs stay exact. E.g. ``("</answer>",)`` ends a turn at the answer's
            closing tag instead of letting the model write on until EOS or the length cap.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in strings):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", strings)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class GenerationResult:
    """One request's output.

    Attributes:
        token_ids: the sampled ids, including the EOS / stop token that ended it (if any).
        logprobs: per sampled token, ``log_softmax(logits / T)`` at that token (see the module docstring); fp32
            values as Python floats; same length as token_ids.
        finish_reason: "stop" (an EOS or stop token was sampled, or a stop string completed), "length"
            (max_new_tokens reached) or "interrupted" (``HFEngine.interrupt`` cut it: the turn is unfinished and
            continues with ``submit(..., resume=result)``).
        raw_logprobs: the same at ``T = 1``; None when the engine does not report them.
        weight_version: the engine's ``weight_version`` when the tokens were sampled.
        stop_string: the ``SamplingParams.stop`` string that ended it ("" when it ended otherwise); its completing
            token is the last of token_ids.
        token_versions: per sampled token, the weight version that sampled it, when the turn was interrupted and
            continued after a weight push (``interrupt`` / ``submit(resume=...)``); None: every token has
            ``weight_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    raw_logprobs: list[float] | None = None
    weight_version: int = 0
    stop_string: str = ""
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """The weight version of every sampled token (``token_versions``, or ``weight_version`` throughout)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.token_ids)


class StopStrings:
    """Token-level stop-string matching for engines that sample one token per step (the built-in engine).

    After each step only rows whose new token can complete a stop string are decoded: a string is completed by the
    token that holds its last character, so tokens whose text holds none of the strings' last characters are skipped
    without decoding (the candidate set is computed once per tokenizer and stop tuple). A candidate row decodes only
    its last ``max(len(stop)) + 8`` tokens (every token but a partial UTF-8 piece decodes to >= 1 character).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], vocab_size: int):
        if tokenizer is None:
            raise ValueError("SamplingParams.stop needs the engine's tokenizer to decode; build the engine with one")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.tail = max(len(s) for s in self.stops) + 8
        lasts = {s[-1] for s in self.stops}
        if all(c.isascii() for c in lasts):
            pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
            # byte-level BPE shows bytes as printable stand-ins; decode each piece to compare real text
            texts = [tokenizer.convert_tokens_to_string([p]) if p is not None else "" for p in pieces]
            hits = [any(c in t for c in lasts) for t in texts]
            self.candidates = np.array(hits + [False] * (vocab_size - len(texts)), dtype=bool)
        else:
            self.candidates = np.ones(vocab_size, dtype=bool)

    def match(self, ids: Sequence[int]) -> str:
        """The stop string that the generated ``ids`` now contain, or ""."""
        if not ids or not self.candidates[ids[-1]]:
            return ""
        text = self.tokenizer.decode(list(ids[-self.tail :]), skip_special_tokens=False)
        return next((s for s in self.stops if s in text), "")

    def first_stop(self, ids: Sequence[int]) -> tuple[int, str]:
        """``(k, s)``: ``ids[:k]`` is where stop string s first completes; ``(len(ids), "")`` when none does."""
        for k in range(1, len(ids) + 1):
            hit = self.match(ids[:k])
            if hit:
                return k, hit
        return len(ids), ""


def stop_matcher(
    cache: dict[tuple[str, ...], StopStrings], tokenizer: Any, stops: tuple[str, ...], vocab_size: int
) -> StopStrings | None:
    """The ``StopStrings`` for ``SamplingParams.stop`` (None when there are none), kept in `cache` by stop tuple.

    Building one scans the whole vocabulary, so an engine passes the same `cache` on every call. Raises
    ValueError when `stops` is non-empty and `tokenizer` is None."""
    if not stops:
        return None
    if stops not in cache:
        cache[stops] = StopStrings(tokenizer, stops, vocab_size)
    return cache[stops]


@dataclass
class Completion:
    """One finished request of the asynchronous interface: the session it sampled for, the caller's tag given to
    ``submit``, and the result (as ``generate_sessions`` returns it; the sampled ids are already appended to the
    session)."""

    session_id: int
    tag: Any
    result: GenerationResult


@dataclass
class EngineStats:
    """Decode counters of an engine since it was built (or since ``reset_stats``).

    Attributes:
        decode_steps: forwards that decode one token per row.
        row_steps: rows computed by those forwards, counting rows that no longer sample (finished rows kept as
            padding, idle slots inside the computed range): the compute spent.
        slot_steps: decode steps x the batch slots the engine held at each step (the rows of the call for a
            lock-step batch, the slot pool for continuous batching): the capacity.
        tokens: sampled tokens, each request's first one (sampled from its prefill's logits) included.
        first_tokens: requests whose first token came from a prefill (not a decode step).
        prefill_tokens: context tokens fed by prefill forwards.
        prefill_positions: query positions those forwards computed, left padding included (>= prefill_tokens; an
            engine that computes no padding leaves it 0).
        prefill_s, decode_s: wall seconds in the prefill forwards (with their KV copies) and in the decode forwards
            (with the slot compaction before them), in the built-in engine; on a GPU each ends with a device
            synchronize, so the time is the kernels'. An engine that does not time its forwards leaves them 0.
    """

    decode_steps: int = 0
    row_steps: int = 0
    slot_steps: int = 0
    tokens: int = 0
    first_tokens: int = 0
    prefill_tokens: int = 0
    prefill_positions: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def since(self, before: EngineStats) -> EngineStats:
        """The counters accumulated after `before` (an earlier copy of these stats): one rollout's or call's."""
        return EngineStats(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def plus(self, other: EngineStats) -> EngineStats:
        """The counters of two engines (or calls) together, field by field."""
        return EngineStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def useful_tokens(self) -> int:
        """Tokens sampled by decode steps (a request's first token comes from its prefill and is not counted)."""
        return self.tokens - self.first_tokens

    def occupancy(self) -> float:
        """Useful decoded tokens / rows computed by decode steps (1.0 = no decode compute wasted)."""
        return self.useful_tokens() / self.row_steps if self.row_steps else 1.0

    def slot_occupancy(self) -> float:
        """Useful decoded tokens / (decode steps x batch slots) (1.0 = no slot ever idles)."""
        return self.useful_tokens() / self.slot_steps if self.slot_steps else 1.0


def check_seeds(seeds: Sequence[int] | None, n: int) -> list[int] | None:
    """Validate per-request seeds: None, or n ints."""
    if seeds is None:
        return None
    seeds = list(seeds)
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} requests; pass one seed per request or None")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"seeds must be ints, got {s!r}")
    return seeds


def check_token_lists(token_lists: Sequence[Sequence[int]], vocab_size: int, what: str, allow_empty: bool) -> None:
    """Validate lists of token ids: ints in [0, vocab_size); empty lists only when `allow_empty`."""
    for i, ids in enumerate(token_lists):
        if not allow_empty and len(ids) == 0:
            raise ValueError(f"{what}[{i}] is empty; pass at least one token id")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"{what}[{i}] holds {t!r}; token ids must be ints in [0, {vocab_size})")


def eos_ids_from(*values: int | Iterable[int] | None) -> tuple[int, ...]:
    """The sorted union of EOS ids given as ints, lists of ints or None (generation config, tokenizer, ...)."""
    ids: set[int] = set()
    for value in values:
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    return tuple(sorted(int(i) for i in ids))


class LockstepQueue:
    """The asynchronous interface (``submit`` / ``step`` / ``num_unfinished`` / ``abort``) for an engine without a
    scheduler of its own: requests wait in a queue and each ``step`` generates all of them in one
    ``generate_sessions`` call per distinct params (the lock-step behaviour, with the same results). Every other
    attribute is the wrapped engine's."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.queue: list[tuple[int, SamplingParams, int | None, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit(self, session_id: int, params: SamplingParams, seed: int | None = None, tag: Any = None) -> None:
        if any(sid == session_id for sid, *_ in self.queue):
            raise ValueError(f"session {session_id} already has a request in flight; wait for its completion")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_seeds(None if seed is None else [seed], 1)
        self.queue.append((session_id, params, seed, tag))

    def step(self) -> list[Completion]:
        queue, self.queue = self.queue, []
        done: list[Completion] = []
        for params in dict.fromkeys(p for _, p, _, _ in queue):
            batch = [q for q in queue if q[1] == params]
            seeds = [s for _, _, s, _ in batch]
            results = self.engine.generate_sessions([sid for sid, *_ in batch], params,
                                                    None if any(s is None for s in seeds) else seeds)
            done += [Completion(sid, tag, r) for (sid, _, _, tag), r in zip(batch, results, strict=True)]
        return done

    def num_unfinished(self) -> int:
        return len(self.queue)

    def abort(self) -> None:
        self.queue = []


def as_async(engine: Any) -> Any:
    """`engine` when it has the asynchronous interface (every :class:`Engine`), else a :class:`LockstepQueue` over
    it (a duck-typed engine with ``generate_sessions`` only)."""
    return engine if callable(getattr(engine, "submit", None)) else LockstepQueue(engine)


class Engine(ABC):
    """A generation engine: stateless ``generate`` plus multi-turn sessions. See the module docstring."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Incremented by every ``sync_weights``; 0 for the weights the engine was built with."""

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        """Sample a continuation of each full prompt (token ids); results in prompt order."""

    @abstractmethod
    def open_sessions(self, n: int) -> list[int]:
        """Open n empty sessions; returns their ids (never reused while open)."""

    @abstractmethod
    def extend(self, session_ids: Sequence[int], new_token_ids: Sequence[Sequence[int]]) -> None:
        """Append tokens (the first prompt, then each observation) to each session's context."""

    @abstractmethod
    def generate_sessions(
        self, session_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        """Sample from each session's current context; the sampled ids are appended to the session."""

    @abstractmethod
    def close_sessions(self, session_ids: Sequence[int]) -> None:
        """Forget the sessions and free their caches."""

    @abstractmethod
    def session_token_ids(self, session_id: int) -> list[int]:
        """A session's full context so far (prompt, observations and sampled tokens)."""

    @abstractmethod
    def sync_weights(self, state_dict_or_model: Mapping[str, Any] | Any, keep_cache: bool = False) -> int:
        """Load new policy weights (a state dict or a module); returns the new ``weight_version``. Caches computed
        with the old weights are dropped; open sessions keep their tokens and are re-prefilled when next used.
        ``keep_cache`` True keeps the open sessions' caches instead (in-flight weight updates,
        ``rollout.partial_kv keep``); an engine that holds no session's cache across a push raises ValueError."""

    # ---- asynchronous interface (the lock-step fallback; engines with a scheduler override all four) -----------

    def _lockstep_queue(self) -> LockstepQueue:
        if "_fallback" not in self.__dict__:
            self.__dict__["_fallback"] = LockstepQueue(self)
        return self.__dict__["_fallback"]

    def submit(self, session_id: int, params: SamplingParams, seed: int | None = None, tag: Any = None) -> None:
        """Queue one turn of `session_id`: sample from its context with `params` and the per-request `seed` (None
        lets the engine draw). The result comes back from a later :meth:`step` as a :class:`Completion` carrying
        `tag`. A session may have one request in flight at a time."""
        self._lockstep_queue().submit(session_id, params, seed, tag)

    def step(self) -> list[Completion]:
        """Advance generation; returns the requests that finished (possibly none; [] when nothing is in flight).
        This fallback generates everything queued in one ``generate_sessions`` call per distinct params."""
        return self._lockstep_queue().step()

    def num_unfinished(self) -> int:
        """Requests submitted and not yet returned by :meth:`step`."""
        return self._lockstep_queue().num_unfinished()

    def abort(self) -> None:
        """Drop every request in flight (after an error in the caller); their sessions keep the tokens they had."""
        self._lockstep_queue().abort()

    def sleep(self) -> None:
        """Release generation memory before a training step (no-op unless the engine supports it)."""
        return None

    def wake_up(self) -> None:
        """Undo ``sleep``."""
        return None

    def close(self) -> None:
        """Free everything the engine holds."""
        return None


@dataclass
class Session:
    """One multi-turn context kept by an engine: every token so far (prompt, observations, sampled tokens).
    Engines subclass it to attach their cache bookkeeping."""

    tokens: list[int] = field(default_factory=list)


class SessionEngine(Engine):
    """The session table shared by the engines: ids, validation, ``extend`` / ``session_token_ids`` /
    ``close_sessions``, the weight-version counter and the per-request seeds drawn when a call passes none.

    A subclass calls ``_init_sessions(seed)`` in its constructor, sets ``vocab_size`` (checked by ``extend``), and
    may override ``_new_session`` (a ``Session`` subclass with cache fields) and ``_release`` (free a session's
    cache when it closes)."""

    vocab_size: int

    def _init_sessions(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._sessions: dict[int, Session] = {}
        self._next_id = itertools.count()
        self._version = 0

    def _new_session(self) -> Session:
        return Session()

    def _release(self, session: Session) -> None:
        """Free what the engine holds for `session` besides its tokens (called by ``close_sessions``)."""
        return None

    def _request_seeds(self, seeds: Sequence[int] | None, n: int) -> list[int]:
        """Validated per-request seeds, or n seeds drawn from the engine's generator when `seeds` is None."""
        checked = check_seeds(seeds, n)
        if checked is None:
            checked = [int(s) for s in self._rng.integers(0, 2**63 - 1, size=n)]
        return checked

    @property
    def weight_version(self) -> int:
        return self._version

    def open_sessions(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        ids = [next(self._next_id) for _ in range(n)]
        for sid in ids:
            self._sessions[sid] = self._new_session()
        return ids

    def _lookup(self, session_ids: Sequence[int]) -> list[Any]:
        """The open sessions of `session_ids`, in order; raises on duplicates and unknown / closed ids."""
        if len(set(session_ids)) != len(session_ids):
            raise ValueError(f"session ids must be unique, got {list(session_ids)}")
        missing = [sid for sid in session_ids if sid not in self._sessions]
        if missing:
            raise ValueError(f"unknown or closed session ids {missing}; pass ids returned by open_sessions")
        return [self._sessions[sid] for sid in session_ids]

    def _check_non_empty(self, session_ids: Sequence[int], sessions: Sequence[Session]) -> None:
        empty = [sid for sid, s in zip(session_ids, sessions, strict=True) if not s.tokens]
        if empty:
            raise ValueError(f"sessions {empty} have no tokens; extend them with a prompt first")

    def extend(self, session_ids: Sequence[int], new_token_ids: Sequence[Sequence[int]]) -> None:
        if len(session_ids) != len(new_token_ids):
            raise ValueError(f"got {len(new_token_ids)} token lists for {len(session_ids)} sessions")
        sessions = self._lookup(session_ids)
        check_token_lists(new_token_ids, self.vocab_size, "new_token_ids", allow_empty=True)
        for session, ids in zip(sessions, new_token_ids, strict=True):
            session.tokens.extend(int(t) for t in ids)

    def session_token_ids(self, session_id: int) -> list[int]:
        return list(self._lookup([session_id])[0].tokens)

    def close_sessions(self, session_ids: Sequence[int]) -> None:
        for session in self._lookup(session_ids):
            self._release(session)
        for sid in session_ids:
            del self._sessions[sid]

    def _close_all_sessions(self) -> None:
        for session in self._sessions.values():
            self._release(session)
        self._sessions.clear()
