"""The built-in generation engine on a transformers causal LM: continuous batching over a slot-based KV cache.

    engine = HFEngine(model_or_path, tokenizer)
    results = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=64), seeds)
    sids = engine.open_sessions(n); engine.extend(sids, prompts); engine.generate_sessions(sids, params, seeds)
    engine.submit(sid, params, seed, tag); completions = engine.step()      # asynchronous: one decode step

Scheduling. Requests wait in a FIFO queue. Each ``step`` (1) admits waiting requests into free KV slots and prefills
their uncached tokens (one forward, or a few when their sizes differ widely) and samples their first token from
the prefill's logits, (2) runs one decode forward over every running request (feeding the token each sampled last)
and samples its next token, and (3) returns the requests that stopped. A slot freed at the end of a step is taken
by the next step's admission before its decode forward, so a turn that ends never leaves its slot idle for one
decode step while its episode's next turn is on its way (the async driver submits it between two steps).
``generate_sessions`` submits its requests and steps until they are done, so
the lock-step interface runs on the same scheduler. Sampling (``fastpo.engine.sampling``) is inverse-CDF sampling on
one uniform per request and step from a counter-based stream of the request's seed, so a request's tokens depend
only on its seed and its context, never on the other rows of the batch (up to float differences of batched matmuls).

KV cache: a pool of slots. Per layer one [S, kv_heads, C, head_dim] buffer for keys and one for values; slot s
holds one session's tokens in columns [0, length[s]), so a token's column is its position id and there are no
holes. A session keeps its slot from turn to turn (the next turn prefills only the new tokens) until it closes, its
cache is dropped (``sync_weights`` without ``keep_cache``, ``reuse_kv=False``), or the slot is taken back for a
waiting request while the session has nothing in flight (least recently used first). Membership changes copy
nothing: a finished row's slot is reused in place. A decode forward covers the slot range [0, hi) holding every
running row (the lowest free slot is taken first, which keeps the range short); rows in the range that do not
sample are fed a masked pad token.
A session's last token (the last sampled one, or the last observation token) is never in the cache: the next
request feeds it, so every prefill has at least one token per row.

Memory: ``2 * layers * kv_heads * head_dim * dtype_bytes * S * C`` for the pool. S grows to the number of requests
running together (capped by ``max_batch_size``); C grows to the longest session's length plus ``max_new_tokens``.
Growing reallocates once (times ``growth``) and copies the pool. ``sync_weights`` drops every cache (they were
computed with the old weights); sessions keep their tokens and are re-prefilled when next used.
``sync_weights(..., keep_cache=True)`` keeps them instead (in-flight weight updates, ``rollout.partial_kv keep``):
the next turn prefills only its new tokens under the new weights, and its queries attend to keys / values the old
weights computed. Its logprobs are those of that mixed computation (docs/SEMANTICS.md section 12).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import gqa_attention
from .base import (
    Completion,
    EngineStats,
    GenerationResult,
    SamplingParams,
    Session,
    SessionEngine,
    StopStrings,
    check_token_lists,
    eos_ids_from,
    stop_matcher,
)
from .packing import split_rows
from .sampling import apply_top_k_top_p, request_uniforms, sample_tokens

__all__ = ["HFEngine", "apply_top_k_top_p", "request_uniforms", "sample_tokens"]


@dataclass
class _Plan:
    """Where one forward's rows live in the pool: ``rows`` int64 [R] slot of each batch row, ``cols`` int64 [R, P]
    the column each new token is written to, ``read`` the slots attention reads (a slice when the rows are the
    slots 0..R-1, else ``rows``), ``width`` how many columns it reads."""

    rows: torch.Tensor
    cols: torch.Tensor
    read: slice | torch.Tensor
    width: int


class _SlotLayer(CacheLayerMixin):
    """One layer of the slot pool, as transformers' cache layer: writes each row's new keys / values at its own
    columns (the pool's current ``_Plan``) and returns the keys / values attention reads."""

    is_sliding = False
    is_compileable = False

    def __init__(self, pool: _SlotPool, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.pool, self.keys, self.values = pool, keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        plan = self.pool.plan
        rows = plan.rows[:, None]
        # [R, kv_heads, P, head_dim] -> [R, P, kv_heads, head_dim], the layout of keys[rows, :, cols]
        self.keys[rows, :, plan.cols] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, plan.cols] = value_states.transpose(1, 2).to(self.values.dtype)
        return self.keys[plan.read, :, : plan.width], self.values[plan.read, :, : plan.width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pool.plan.width, 0

    def get_seq_length(self) -> int:
        return self.pool.plan.width

    def get_max_length(self) -> int:
        return -1


class _SlotPool:
    """The KV slots (see the module docstring). ``lengths[s]``: cached tokens of slot s; ``owner[s]``: the session
    id holding it, or None when free."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        num_layers = shape[0]
        self.layers = [_SlotLayer(self, self._empty(0, 0), self._empty(0, 0)) for _ in range(num_layers)]
        self.cache = Cache(layers=self.layers)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.owner: list[int | None] = []
        self.plan: _Plan | None = None

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        _, kv_heads, head_dim = self.shape
        return torch.zeros(slots, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)

    @property
    def slots(self) -> int:
        return len(self.owner)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    def reserve(self, slots: int, capacity: int, growth: float) -> None:
        """At least `slots` slots (exactly that many when it grows: the engine decides, within max_batch_size) and
        `capacity` columns (times `growth` when it grows); reallocates (one copy of the pool) when either grows."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, self.slots)
        new_cap = self.capacity if capacity <= self.capacity else max(capacity, int(self.capacity * growth))
        old_slots, old_cap = self.slots, self.capacity
        for layer in self.layers:
            for name in ("keys", "values"):
                new = self._empty(new_slots, new_cap)
                new[:old_slots, :, :old_cap].copy_(getattr(layer, name))
                setattr(layer, name, new)
        self.lengths = np.concatenate([self.lengths, np.zeros(new_slots - old_slots, dtype=np.int64)])
        self.owner += [None] * (new_slots - old_slots)

    def copy_slot(self, src: int, dst: int, columns: int) -> None:
        """Copy the first `columns` cached columns of slot `src` into slot `dst`."""
        for layer in self.layers:
            layer.keys[dst, :, :columns].copy_(layer.keys[src, :, :columns])
            layer.values[dst, :, :columns].copy_(layer.values[src, :, :columns])
        self.lengths[dst] = columns


@dataclass
class _Session(Session):
    tokens: list[int] = field(default_factory=list)
    cached: int = 0  # tokens[:cached] are in the pool, slot `slot`
    slot: int = -1
    last_used: int = 0  # the engine's step counter when it last ran (eviction picks the oldest idle slot)


@dataclass
class _Request:
    """A request in the queue or running: its session, params, random stream and the tokens sampled so far."""

    session_id: int
    session: _Session
    params: SamplingParams
    uniforms: np.ndarray
    tag: Any
    stops: frozenset[int]
    matcher: StopStrings | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    stop_string: str = ""
    finished: bool = False
    queued_at: int = 0  # the engine's step counter when it was submitted
    resumed: int = 0  # tokens sampled before an interruption (already in the session); the rest are this request's
    versions: list[int] = field(default_factory=list)  # the weight version of each of those earlier tokens


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    # flip only a model in training mode: eval() / train() walk every submodule, and on a small model two walks per
    # engine step cost ~15% of its decode (the trainer's engine model is its own copy, already in eval mode)
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if was_training:
            model.train()


class HFEngine(SessionEngine):
    """Continuous-batching sampling with a slot-based KV cache on a transformers causal LM (module docstring).

    Args:
        model: a causal LM module (used as is, shared with the caller) or a path / hub id (loaded with
            ``fastpo.model.load_policy(model, dtype)``).
        tokenizer: optional; its ``eos_token_id`` and ``pad_token_id`` complement the model's generation config.
        eos_token_ids: the ids that end a request (default: generation config + tokenizer eos).
        reuse_kv: keep each session's cache across turns (True) or re-prefill the whole history every turn.
        seed: seeds the per-request seeds drawn when a call passes ``seeds=None``.
        dtype: the dtype when `model` is a path.
        max_batch_size: at most this many requests run (decode) together; the others wait for a free slot.
            None: as many as are submitted.
        max_prefill_tokens: prefill in column chunks of ``max(1, max_prefill_tokens // R)`` to bound activations.
        growth: capacity factor when the pool must grow (slots or columns).
        admit_wait: while other requests decode, a newly submitted request may wait up to this many steps so that
            its prefill shares one forward with later arrivals (it joins at once when the queue holds at least half
            as many requests as are running). 0: admit at every step. Never changes a request's tokens. Default 2:
            on the tiny preset's short turns it brings the async rollout from 0.89x to 0.98x lock-step's speed
            (fewer prefill forwards: 9 instead of 16; docs/ENGINES.md); lock-step calls are never held.
        gqa_sdpa: on a CPU, run grouped-KV models' forwards through SDPA with ``enable_gqa`` and the engine's mask
            instead of transformers' per-head KV copy (``fastpo.engine.attention``; same tokens). False keeps the
            model's own attention (the benchmarks' baseline).
        split_prefill: prefill one admission's rows in several forwards when their sizes differ widely
            (``fastpo.engine.packing``: a long first prompt does not pad the short turns admitted with it). False:
            one forward for all of them (the benchmarks' baseline).
    """

    def __init__(
        self,
        model: nn.Module | str,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        reuse_kv: bool = True,
        seed: int = 0,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int | None = None,
        max_prefill_tokens: int = 65536,
        growth: float = 1.5,
        admit_wait: int = 2,
        gqa_sdpa: bool = True,
        split_prefill: bool = True,
    ):
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            from ..model import load_policy

            model = load_policy(model, dtype=dtype)
        self.model = model
        self.tokenizer = tokenizer
        self._stop_matchers: dict[tuple[str, ...], StopStrings] = {}
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"HFEngine supports full-attention layers only, the model has {sorted(set(layer_types))}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = (
            tuple(sorted(set(eos_token_ids))) if eos_token_ids is not None else self._eos_ids(tokenizer)
        )
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(model.generation_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be an int >= 1 or None, got {max_batch_size!r}")
        if max_prefill_tokens < 1 or growth < 1.0:
            raise ValueError(f"need max_prefill_tokens >= 1 and growth >= 1; got {max_prefill_tokens}, {growth}")
        self.reuse_kv = reuse_kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.growth = growth
        if isinstance(admit_wait, bool) or not isinstance(admit_wait, int) or admit_wait < 0:
            raise ValueError(f"admit_wait must be an int >= 0, got {admit_wait!r}")
        self.admit_wait = admit_wait
        self.gqa_sdpa = bool(gqa_sdpa)
        self.split_prefill = bool(split_prefill)
        self._pool = _SlotPool((config.num_hidden_layers, kv_heads, head_dim), self.dtype, self.device)
        self._waiting: list[_Request] = []
        self._running: dict[int, _Request] = {}  # slot -> request
        self._inflight: dict[int, _Request] = {}  # session id -> request (waiting or running)
        self._ready: list[Completion] = []  # finished while generate_sessions drove the loop for other requests
        self._logits = torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)
        self._clock = 0
        self.stats = EngineStats()
        self._init_sessions(seed)

    def _eos_ids(self, tokenizer: Any) -> tuple[int, ...]:
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        return eos_ids_from(gen_eos, getattr(tokenizer, "eos_token_id", None))

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    def reset_stats(self) -> EngineStats:
        """Return the counters so far and start new ones."""
        stats, self.stats = self.stats, EngineStats()
        return stats

    # ---- sessions (the table is SessionEngine's; this engine adds each session's slot) ------------------------

    def _new_session(self) -> _Session:
        return _Session()

    def _drop_cache(self, session: _Session) -> None:
        """Forget `session`'s cache and free its slot (it re-prefills its tokens when next used)."""
        if session.slot >= 0:
            self._pool.owner[session.slot] = None
            self._pool.lengths[session.slot] = 0
        session.slot, session.cached = -1, 0

    def _release(self, session: _Session) -> None:
        """close_sessions: abort the session's request in flight, if any, and free its slot."""
        for sid, request in list(self._inflight.items()):
            if request.session is session:
                self._forget(sid, request)
        self._drop_cache(session)

    def _forget(self, session_id: int, request: _Request) -> None:
        self._inflight.pop(session_id, None)
        if request in self._waiting:
            self._waiting.remove(request)
        for slot, running in list(self._running.items()):
            if running is request:
                del self._running[slot]

    # ---- the asynchronous interface ---------------------------------------------------------------------------

    def submit(self, session_id: int, params: SamplingParams, seed: int | None = None, tag: Any = None,
               resume: GenerationResult | None = None) -> None:
        """Queue one turn of `session_id` (see ``Engine.submit``). ``resume``: the result :meth:`interrupt` returned
        for this session's turn; the request continues that turn instead of starting a new one. Its tokens are
        already in the session (nothing is re-sampled); it samples on from the same seed's stream at the same index
        (so, under unchanged weights and cache, the continued turn equals an uninterrupted one token for token),
        counts them against ``max_new_tokens`` and in stop strings, and its completion returns the whole turn
        (``token_versions`` says which version sampled each token)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        session = self._lookup([session_id])[0]
        self._check_non_empty([session_id], [session])
        if session_id in self._inflight:
            raise ValueError(f"session {session_id} already has a request in flight; wait for its completion")
        earlier = [] if resume is None else list(resume.token_ids)
        if resume is not None:
            if resume.finish_reason != "interrupted":
                raise ValueError(f"resume takes an interrupted turn's result, got finish_reason "
                                 f"{resume.finish_reason!r}")
            if len(earlier) >= params.max_new_tokens or session.tokens[len(session.tokens) - len(earlier):] != earlier:
                raise ValueError(f"resume: session {session_id} does not end with the interrupted turn's "
                                 f"{len(earlier)} tokens (or they fill max_new_tokens={params.max_new_tokens})")
        seed = self._request_seeds(None if seed is None else [seed], 1)[0]
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        request = _Request(session_id, session, params, request_uniforms([seed], params.max_new_tokens)[0], tag,
                           stops, stop_matcher(self._stop_matchers, self.tokenizer, params.stop, self.vocab_size),
                           tokens=earlier, queued_at=self._clock, resumed=len(earlier))
        if resume is not None:
            request.logprobs = list(resume.logprobs)
            # NaN, not a made-up value, where the interrupted result reported none (HFEngine always reports them)
            request.raw = list(resume.raw_logprobs) if resume.raw_logprobs is not None else [math.nan] * len(earlier)
            request.versions = resume.versions()
        self._waiting.append(request)
        self._inflight[session_id] = request

    def interrupt(self) -> list[Completion]:
        """End every request in flight now, keeping what it sampled (the iteration boundary of partial rollouts
        that split turns, ``rollout.partial_interrupt``). A running request's tokens join its session (its cache
        stays, as after a finished turn); a waiting one has sampled nothing. Each comes back as a completion with
        ``finish_reason`` "interrupted" (completions that finished normally and were not returned yet come back
        too); continue one with ``submit(session, params, seed, resume=result)``."""
        done, self._ready = self._ready, []
        for slot in sorted(self._running):
            done.append(self._finish(slot, self._running[slot], interrupted=True))
        for request in list(self._waiting):
            self._waiting.remove(request)
            del self._inflight[request.session_id]
            done.append(Completion(request.session_id, request.tag, self._result(request, "interrupted")))
        return done

    def num_unfinished(self) -> int:
        return len(self._inflight)

    def abort(self) -> None:
        """Drop every request in flight; their sessions keep the tokens they had before the request and lose their
        caches (a half-updated cache is never reused)."""
        for request in list(self._inflight.values()):
            self._drop_cache(request.session)
        self._waiting, self._running, self._inflight = [], {}, {}

    def step(self) -> list[Completion]:
        done, self._ready = self._ready, []
        if not self._inflight:
            return done
        self._clock += 1
        try:
            with _eval_mode(self.model):
                done += self._sample(self._admit())  # first tokens, from the prefill's logits
                if self._running:
                    self._decode()
                    done += self._sample(sorted(self._running))
        except BaseException:
            self.abort()
            raise
        return done

    # ---- the lock-step interface on the same scheduler ----------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        check_token_lists(prompts, self.vocab_size, "prompts", allow_empty=False)
        sids = self.open_sessions(len(prompts))
        try:
            self.extend(sids, prompts)
            return self.generate_sessions(sids, params, seeds)
        finally:
            self.close_sessions(sids)

    def generate_sessions(
        self, session_ids: Sequence[int], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[GenerationResult]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        session_ids = list(session_ids)
        sessions = self._lookup(session_ids)
        if not sessions:
            return []
        self._check_non_empty(session_ids, sessions)
        busy = [sid for sid in session_ids if sid in self._inflight]
        if busy:
            raise ValueError(f"sessions {busy} already have a request in flight; wait for its completion")
        seeds = self._request_seeds(seeds, len(sessions))
        mine = object()  # tags of this call: other callers' completions are kept for their next step()
        for k, (sid, seed) in enumerate(zip(session_ids, seeds, strict=True)):
            self.submit(sid, params, seed, (mine, k))
        results: list[GenerationResult | None] = [None] * len(sessions)
        others: list[Completion] = []
        left = len(sessions)
        while left:
            for done in self.step():
                if isinstance(done.tag, tuple) and len(done.tag) == 2 and done.tag[0] is mine:
                    results[done.tag[1]] = done.result
                    left -= 1
                else:
                    others.append(done)
        self._ready = others + self._ready
        return results  # type: ignore[return-value]

    # ---- scheduling -------------------------------------------------------------------------------------------

    def _slot_for(self, request: _Request) -> int:
        """A slot for `request`'s session: its own, a free one (lowest first), an idle session's (least recently
        used; that session re-prefills later) or a new one; -1 when every slot runs a request."""
        session, pool = request.session, self._pool
        if session.slot >= 0:
            return session.slot
        free = [s for s in range(pool.slots) if pool.owner[s] is None]
        if not free and (self.max_batch_size is None or pool.slots < self.max_batch_size):
            want = pool.slots + 1 if self.max_batch_size is None else min(pool.slots + 1, self.max_batch_size)
            self._grow(slots=max(want, len(self._running) + len(self._waiting)))
            free = [s for s in range(pool.slots) if pool.owner[s] is None]
        if free:
            return free[0]
        idle = [s for s in range(pool.slots) if s not in self._running and pool.owner[s] not in self._inflight]
        if not idle:
            return -1
        slot = min(idle, key=lambda s: self._sessions[pool.owner[s]].last_used)
        self._drop_cache(self._sessions[pool.owner[slot]])
        return slot

    def _grow(self, slots: int = 0, capacity: int = 0) -> None:
        if self.max_batch_size is not None:
            slots = min(slots, self.max_batch_size)
        pool = self._pool
        if slots > pool.slots and pool.slots:
            slots = max(slots, int(pool.slots * self.growth))
            if self.max_batch_size is not None:
                slots = min(slots, self.max_batch_size)
        pool.reserve(max(slots, pool.slots), capacity, self.growth)
        if self._logits.shape[0] < pool.slots:
            logits = self._logits.new_zeros(pool.slots, self.vocab_size)
            logits[: self._logits.shape[0]] = self._logits
            self._logits = logits

    def _admit(self) -> list[int]:
        """Give waiting requests slots (FIFO, as long as slots are free) and prefill their uncached tokens. Returns
        the admitted slots (their next-token logits are in ``self._logits``)."""
        if (self._waiting and self._running and self.admit_wait and 2 * len(self._waiting) < len(self._running)
                and self._clock - min(r.queued_at for r in self._waiting) <= self.admit_wait):
            return []  # a few arrivals while many decode: let their prefill share a forward with the next ones
        admitted: list[tuple[int, _Request]] = []
        # requests whose session holds a slot need no new one: they go first (a queued request must never wait
        # for a slot that its own session holds), then the others in arrival order
        self._waiting.sort(key=lambda r: r.session.slot < 0)
        while self._waiting:
            request = self._waiting[0]
            slot = self._slot_for(request)
            if slot < 0:
                break
            self._waiting.pop(0)
            session = request.session
            if not self.reuse_kv:
                self._drop_cache(session)
            session.slot = slot
            self._pool.owner[slot] = request.session_id
            self._pool.lengths[slot] = session.cached
            admitted.append((slot, request))
        if not admitted:
            return []
        # room for the whole turn: the context, the new tokens, max_new_tokens, and the column a masked row writes
        need = max(len(r.session.tokens) + r.params.max_new_tokens + 1 for _, r in admitted)
        self._grow(capacity=need)
        self._prefill([(slot, r.session.tokens[r.session.cached:]) for slot, r in admitted])
        for slot, request in admitted:
            request.session.cached = len(request.session.tokens)
            request.session.last_used = self._clock
            self._running[slot] = request
        return sorted(slot for slot, _ in admitted)

    def _prefill(self, rows: list[tuple[int, list[int]]]) -> None:
        """Feed each (slot, new tokens); their next-token logits go to ``self._logits[slot]``.

        Fresh rows that repeat a prompt (a GRPO group's rollouts start from one state) are computed once and their
        KV columns copied to the others (the same numbers, up to the float differences of another batch size). The
        rest go in one forward, or several when their sizes differ enough (``packing.split_rows``)."""
        pool, t0 = self._pool, time.perf_counter()
        first: dict[tuple[int, ...], int] = {}
        compute: list[tuple[int, list[int]]] = []
        copies: list[tuple[int, int, int]] = []  # (source slot, destination slot, columns)
        for slot, ids in rows:
            key = tuple(ids)
            if pool.lengths[slot] == 0 and key in first:
                copies.append((first[key], slot, len(ids)))
                continue
            if pool.lengths[slot] == 0:
                first[key] = slot
            compute.append((slot, ids))
        # unequal rows go in separate forwards when padding them together would cost more (fastpo.engine.packing)
        ends = [int(pool.lengths[slot]) + len(ids) for slot, ids in compute]
        groups = split_rows([len(ids) for _, ids in compute], ends) if self.split_prefill else [range(len(compute))]
        for group in groups:
            self._prefill_rows([compute[i] for i in group])
        for src, dst, columns in copies:
            pool.copy_slot(src, dst, columns)
            self._logits[dst] = self._logits[src]
        self.stats.prefill_tokens += sum(len(ids) for _, ids in compute)
        self.stats.prefill_s += self._since(t0)

    def _prefill_rows(self, rows: list[tuple[int, list[int]]]) -> None:
        """One left-padded [R, P] forward (in column chunks) over the rows' new tokens. Row r's real tokens go to
        columns [len_r, len_r + n_r); its pad queries write past them (columns that are not valid yet)."""
        pool, device = self._pool, self.device
        count, width = len(rows), max(len(ids) for _, ids in rows)
        host_slots, host_starts = [s for s, _ in rows], [int(pool.lengths[s]) for s, _ in rows]
        slots = torch.tensor(host_slots, dtype=torch.long, device=device)
        starts = torch.tensor(host_starts, dtype=torch.long, device=device)
        sizes = torch.tensor([len(ids) for _, ids in rows], dtype=torch.long, device=device)
        input_ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)
        for row, (_, ids) in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        input_ids = input_ids.to(device)
        j = torch.arange(width, device=device)[None, :]
        pad = width - sizes[:, None]  # leading pad queries of each row
        real = j >= pad
        # real query j sits at column len + (j - pad); pad queries after the row's real tokens
        cols = torch.where(real, starts[:, None] + j - pad, starts[:, None] + sizes[:, None] + j)
        positions = torch.where(real, cols, starts[:, None])
        # decided on the host copies: reading device tensors back would wait for the GPU before each prefill
        read = slice(0, count) if host_slots == list(range(count)) else slots
        total = max(host_starts) + width
        self._grow(capacity=total + 1)  # a short row next to a long one writes pad queries up to start + width
        self.stats.prefill_positions += count * width
        chunk = max(1, self.max_prefill_tokens // count)
        for c0 in range(0, width, chunk):
            c1 = min(width, c0 + chunk)
            logits = self._forward(slots, input_ids[:, c0:c1], cols[:, c0:c1], positions[:, c0:c1], read, total)
        self._logits[slots] = logits
        for s, ids in rows:
            pool.lengths[s] += len(ids)

    def _forward(self, rows: torch.Tensor, input_ids: torch.Tensor, cols: torch.Tensor, positions: torch.Tensor,
                 read: slice | torch.Tensor, width: int) -> torch.Tensor:
        """Run the model on [R, P] new tokens written at `cols` of slots `rows`; returns the last column's logits
        [R, V] fp32. Query (r, j) attends to the columns <= its own (a slot's valid columns are a prefix)."""
        pool = self._pool
        pool.plan = _Plan(rows, cols, read, width)
        mask = torch.arange(width, device=cols.device)[None, None, :] <= cols[:, :, None]  # [R, P, width]
        # an additive mask works for every attention implementation (sdpa, eager) and never masks a whole row
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=cols.device)
        bias.masked_fill_(~mask, torch.finfo(self.dtype).min)
        try:
            with gqa_attention(self.model, self.device) if self.gqa_sdpa else contextlib.nullcontext():
                out = self.model(input_ids=input_ids, attention_mask=bias[:, None], position_ids=positions,
                                 past_key_values=pool.cache, use_cache=True, logits_to_keep=1)
        finally:
            pool.plan = None
        return out.logits[:, -1].float()

    def _sample(self, slots: list[int]) -> list[Completion]:
        """Sample one token for the running requests in `slots` (ascending) from their logits in ``self._logits``
        and finish those that stopped; the others keep the token to feed at the next decode."""
        if not slots:
            return []
        requests = [self._running[s] for s in slots]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        tokens = torch.empty(len(slots), dtype=torch.long)
        logps = torch.empty(len(slots), dtype=torch.float32)
        raws = torch.empty(len(slots), dtype=torch.float32)
        for params in dict.fromkeys(r.params for r in requests):  # usually one
            which = [k for k, r in enumerate(requests) if r.params == params]
            u = torch.from_numpy(np.array([requests[k].uniforms[len(requests[k].tokens)] for k in which]))
            logits = self._logits[index if len(which) == len(slots) else index[which]]
            tok, lp, raw = sample_tokens(logits, u.to(self.device), params.temperature, params.top_k, params.top_p)
            # one device-to-host copy, not three (each is a wait on a GPU); float64 holds the ids and fp32 exactly
            host = torch.stack([tok.double(), lp.double(), raw.double()]).cpu()
            tokens[which], logps[which], raws[which] = host[0].long(), host[1].float(), host[2].float()
        self.stats.tokens += len(slots)
        self.stats.first_tokens += sum(1 for r in requests if len(r.tokens) == r.resumed)
        done: list[Completion] = []
        for k, (slot, request) in enumerate(zip(slots, requests, strict=True)):
            token = int(tokens[k])
            request.tokens.append(token)
            request.logprobs.append(float(logps[k]))
            request.raw.append(float(raws[k]))
            if request.matcher is not None and token not in request.stops:
                request.stop_string = request.matcher.match(request.tokens)
            if token in request.stops or request.stop_string or len(request.tokens) >= request.params.max_new_tokens:
                done.append(self._finish(slot, request))
        return done

    def _finish(self, slot: int, request: _Request, interrupted: bool = False) -> Completion:
        del self._running[slot]
        del self._inflight[request.session_id]
        session = request.session
        session.tokens.extend(request.tokens[request.resumed:])  # a resumed turn's earlier tokens are there already
        # the last sampled token is never in the cache (a decode feeds it, and a request leaves right after sampling)
        session.cached = len(session.tokens) - 1
        self._pool.lengths[slot] = session.cached
        if interrupted:
            reason = "interrupted"
        else:
            reason = "stop" if request.tokens[-1] in request.stops or request.stop_string else "length"
        if not self.reuse_kv:
            self._drop_cache(session)
        return Completion(request.session_id, request.tag, self._result(request, reason))

    def _result(self, request: _Request, reason: str) -> GenerationResult:
        """The request's whole turn so far as a result (a resumed turn's earlier tokens first)."""
        versions = None  # every token of an uncut turn has the current version
        if request.resumed:
            versions = request.versions + [self._version] * (len(request.tokens) - request.resumed)
        return GenerationResult(
            token_ids=list(request.tokens), logprobs=list(request.logprobs), finish_reason=reason,
            raw_logprobs=list(request.raw), weight_version=self._version, stop_string=request.stop_string,
            token_versions=versions)

    def _decode(self) -> None:
        """One decode forward over the slots [0, hi) that hold every running row, each feeding the token it sampled
        last; the other rows in the range feed a masked pad token at their first free column (nothing valid is
        overwritten). Leaves every running row's next-token logits in ``self._logits``."""
        pool, device, t0 = self._pool, self.device, time.perf_counter()
        self._compact()
        hi = max(self._running) + 1
        fed = torch.full((hi,), self.pad_token_id, dtype=torch.long)
        for slot, request in self._running.items():
            fed[slot] = request.tokens[-1]
        host_lengths = pool.lengths[:hi].copy()
        lengths = torch.from_numpy(host_lengths).to(device)
        rows = torch.arange(hi, device=device)
        cols = lengths[:, None]
        # the width from the host copy: reading it back from the device would wait for the GPU before the forward
        logits = self._forward(rows, fed[:, None].to(device), cols, cols, slice(0, hi), int(host_lengths.max()) + 1)
        self._logits[:hi] = logits
        for slot in self._running:
            pool.lengths[slot] += 1
        self.stats.decode_steps += 1
        self.stats.row_steps += hi
        self.stats.slot_steps += pool.slots
        self.stats.decode_s += self._since(t0)

    def _since(self, t0: float) -> float:
        """Seconds since `t0` (``time.perf_counter``), after the device's queued kernels have run."""
        device = self._pool.device  # a plain attribute: ``self.device`` looks up the lm head on every call
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def _compact(self) -> None:
        """When fewer than half of the decode range [0, hi) runs (the tail of a rollout: the last episodes sit in high
        slots), move the running rows above the free low slots down into them: one copy of each moved row's cache,
        after which every decode step computes fewer idle rows."""
        pool = self._pool
        hi = max(self._running) + 1
        if len(self._running) * 2 > hi:
            return
        free = [s for s in range(hi) if pool.owner[s] is None]
        for src in sorted(self._running, reverse=True):
            if not free or free[0] >= src:
                break
            dst = free.pop(0)
            request = self._running.pop(src)
            pool.copy_slot(src, dst, int(pool.lengths[src]))
            pool.owner[dst], pool.owner[src], pool.lengths[src] = pool.owner[src], None, 0
            self._logits[dst] = self._logits[src]
            request.session.slot = dst
            self._running[dst] = request
            free.append(src)
            free.sort()

    # ---- weights --------------------------------------------------------------------------------------------

    def sync_weights(self, state_dict_or_model: Mapping[str, Any] | nn.Module, keep_cache: bool = False) -> int:
        """Copy new weights into the engine's model (a no-op copy when given the engine's own module). Accepts a
        module (peft-wrapped modules: merge the adapter first) or a state dict whose tensors may be DTensors
        (gathered with ``full_tensor``). Returns the new weight_version. Refused while requests are in flight: their
        tokens so far came from the old weights (``interrupt`` ends them first when a turn is to continue under the
        new ones).

        keep_cache: False (default) drops every session's cache: the next turn of a session re-prefills its whole
            context under the new weights, so every logprob is the new policy's exactly. True keeps each open
            session's slot and cached columns (only the weights change and the version moves on): the next turn
            prefills only its new tokens (the last sampled token and the new observation), under the new weights,
            and attends to the cached keys / values the older weights computed. No prefill of the old context; the
            sampled tokens and their logprobs come from that mixed computation. With the same weights both give
            the same tokens and logprobs (up to the float differences of another batch shape)."""
        if self._inflight:
            raise RuntimeError(f"sync_weights with {len(self._inflight)} request(s) in flight; step until they "
                               f"finish or abort() them first")
        src = state_dict_or_model
        if src is not self.model:
            state = src.state_dict() if isinstance(src, nn.Module) else dict(src)
            state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
            own = self.model.state_dict()
            unexpected = sorted(set(state) - set(own))
            tied = {k for k in own if k.endswith("lm_head.weight")} if self._tied() else set()
            missing = sorted(set(own) - set(state) - tied)
            if unexpected or missing:
                raise ValueError(
                    f"state dict does not match the engine's model: missing {missing[:5]}, unexpected"
                    f" {unexpected[:5]}; pass the policy's state_dict (unwrapped, adapters merged)"
                )
            with torch.no_grad():
                for name, value in state.items():
                    own[name].copy_(value)
        if not keep_cache:
            for session in self._sessions.values():
                self._drop_cache(session)
        self._version += 1
        return self._version

    def _tied(self) -> bool:
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return head is not None and embed is not None and head.weight is embed.weight

    def close(self) -> None:
        self.abort()
        self._close_all_sessions()

