"""The built-in generation engine on a transformers causal LM: batched sampling with a KV cache.

    engine = HFEngine(model_or_path, tokenizer)
    results = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=64), seeds)
    sids = engine.open_sessions(n); engine.extend(sids, prompts); engine.generate_sessions(sids, params, seeds)

One call = ``prefill`` (the pending tokens of every request, left-padded into one [B, P] chunk) then
``decode_one_token`` for the whole batch until every row has stopped; finished rows keep running as masked
padding (their KV columns are marked invalid). Sampling (``sample_tokens``) is inverse-CDF sampling on one
uniform per request and step, drawn from a counter-based stream (splitmix64 of (seed, step)), so a request's
tokens depend only on its seed and its own logits, never on the other rows of the batch.

KV cache and sessions. Sessions that are generated together share a ``_KVGroup``: per layer one preallocated
[B, kv_heads, capacity, head_dim] buffer for keys and one for values, a [B, capacity] bool mask of valid columns
and the next position id of each row. Columns are shared by the rows (a forward writes the same columns for all
rows), rows differ in which columns are valid: left padding, padding inside a turn (rows with shorter
observations), and the steps after a row stopped, are invalid columns ("holes"). Position ids count valid tokens
only, so the result equals a fresh forward over the row's tokens (checked within 1e-5 in fp32 by the tests).
A session's last token (the last sampled one, or the last observation token) is never in the cache: it is fed
by the next call, which therefore always has at least one token per row to produce the first logits.

Memory behaviour:
- A group holds ``2 * layers * kv_heads * head_dim * dtype_bytes`` per column and row, for ``capacity``
  columns: at least the longest row's valid tokens plus its holes. A call grows the buffers once (to the current
  length + pending + max_new_tokens, times ``growth`` when it must reallocate); nothing is copied per step.
- A group is rebuilt (compacted: rows right-aligned, holes dropped) when a call asks for a different set or
  order of sessions than the group holds, or when fewer than ``compact_below`` (0.5) of its columns x rows are
  valid. Rebuilding copies the KV of the sessions involved once (old and new buffers coexist during the copy).
  Rows of sessions that moved to another group or were closed stay allocated until every session of their group
  has moved or closed; close sessions you no longer need. Peak: about twice the live KV during a rebuild.
- ``reuse_kv=False`` keeps no cache between calls: every call re-prefills the whole history (the baseline).
- ``sync_weights`` drops all caches (they were computed with the old weights); sessions keep their tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .base import (
    GREEDY_EPS,
    GenerationResult,
    SamplingParams,
    Session,
    SessionEngine,
    StopStrings,
    check_token_lists,
    eos_ids_from,
    stop_matcher,
)

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def request_uniforms(seeds: Sequence[int], steps: int) -> np.ndarray:
    """The random stream of each request: ``u[i, t]`` in [0, 1) is the t-th draw of request i.

    A function of ``(seeds[i], t)`` only (splitmix64 seeded with a mix of the seed), so it does not depend on the
    batch, the device or torch's global RNG. Returns float64 [len(seeds), steps] with 53 random bits each.
    """
    mask = (1 << 64) - 1
    with np.errstate(over="ignore"):
        state = _mix64(np.array([int(s) & mask for s in seeds], dtype=np.uint64) ^ np.uint64(0x5851F42D4C957F2D))
        counters = state[:, None] + np.arange(1, steps + 1, dtype=np.uint64)[None, :] * _GOLDEN_GAMMA
        bits = _mix64(counters)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k and then top-p exclude (vLLM's order: top-p acts on the top-k renormalised
    distribution; ties at the k-th value are kept). logits: [B, V] fp32 (already divided by the temperature)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p  # the kept prefix is the smallest one whose mass reaches top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: [B, V] (any float dtype; computed in fp32).
        uniforms: [B] float64 in [0, 1): each row's draw (``request_uniforms``); unused when greedy.
        temperature: < 1e-5 means argmax.
        top_k, top_p: restrict the tokens that can be drawn (``apply_top_k_top_p``).

    Returns:
        tokens [B] int64; logprobs [B] fp32 = ``log_softmax(logits / T)`` at the token over the full vocab (T = 1
        when greedy); raw_logprobs [B] fp32 = ``log_softmax(logits)`` at the token.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    if temperature < GREEDY_EPS:
        tokens = logits.argmax(dim=-1)
        picked = raw.gather(1, tokens[:, None]).squeeze(1)
        return tokens, picked, picked
    scaled = logits if temperature == 1.0 else logits / temperature
    logp = raw if temperature == 1.0 else torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k, top_p), dim=-1)
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total: never step past the last token that may be drawn.
    last_allowed = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    tokens = torch.minimum(tokens, last_allowed)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), raw.gather(1, tokens[:, None]).squeeze(1)


class _SlabLayer(CacheLayerMixin):
    """One layer of a group's cache for transformers: writes new keys/values into preallocated buffers
    [B, kv_heads, capacity, head_dim] at columns [length, length + n) and returns the views [.., :length + n, :]."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        end = self.length + key_states.shape[-2]
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class _KVGroup:
    """The cache of sessions generated together (see the module docstring).

    Attributes:
        session_ids: the session of each row; None for a row whose session moved away or closed.
        layers: one ``_SlabLayer`` per model layer; ``cache`` wraps them for the model's forward.
        valid: [B, capacity] bool, True where a column holds one of the row's tokens.
        next_pos: [B] int64, the number of valid columns of each row (= the next token's position id).
    """

    def __init__(self, session_ids: list[int | None], shape: tuple[int, int, int], capacity: int, dtype, device):
        num_layers, kv_heads, head_dim = shape
        rows = len(session_ids)
        self.session_ids = session_ids
        self.layers = [
            _SlabLayer(
                torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device),
                torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device),
                0,
            )
            for _ in range(num_layers)
        ]
        self.cache = Cache(layers=self.layers)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def reserve(self, columns: int, growth: float) -> None:
        """Make room for `columns` more columns; reallocates (and copies) at most once."""
        need = self.length + columns
        if need <= self.capacity:
            return
        new_cap = max(need, int(self.capacity * growth))
        used = self.length
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
                new[:, :, :used].copy_(old[:, :, :used])
                setattr(layer, name, new)
        valid = self.valid.new_zeros(self.valid.shape[0], new_cap)
        valid[:, :used] = self.valid[:, :used]
        self.valid = valid

    def fill_ratio(self) -> float:
        total = len(self.session_ids) * max(self.length, 1)
        return float(self.next_pos.sum()) / total


@dataclass
class _Session(Session):
    tokens: list[int] = field(default_factory=list)
    cached: int = 0  # tokens[:cached] are in the cache of `group` (row `row`)
    group: _KVGroup | None = None
    row: int = -1


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


class HFEngine(SessionEngine):
    """Batched sampling with a KV cache on a transformers causal LM (see the module docstring).

    Args:
        model: a causal LM module (used as is, shared with the caller) or a path / hub id (loaded with
            ``fastpo.model.load_policy(model, dtype)``).
        tokenizer: optional; its ``eos_token_id`` and ``pad_token_id`` complement the model's generation config.
        eos_token_ids: the ids that end a request (default: generation config + tokenizer eos).
        reuse_kv: keep each session's cache across calls (True) or re-prefill the whole history every call.
        seed: seeds the per-request seeds drawn when a call passes ``seeds=None``.
        dtype: the dtype when `model` is a path.
        max_batch_size: split calls with more requests into chunks of this many (each chunk its own group).
        max_prefill_tokens: prefill in column chunks of ``max(1, max_prefill_tokens // B)`` to bound activations.
        growth: capacity factor when a group's buffers must grow.
        compact_below: rebuild a group when fewer than this fraction of its columns x rows are valid.
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
        compact_below: float = 0.5,
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
        self._shape = (config.num_hidden_layers, kv_heads, head_dim)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = (
            tuple(sorted(set(eos_token_ids))) if eos_token_ids is not None else self._eos_ids(tokenizer)
        )
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(model.generation_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")
        if max_prefill_tokens < 1 or growth < 1.0 or not 0.0 <= compact_below < 1.0:
            raise ValueError(
                f"need max_prefill_tokens >= 1, growth >= 1, 0 <= compact_below < 1; got {max_prefill_tokens},"
                f" {growth}, {compact_below}"
            )
        self.reuse_kv = reuse_kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.growth = growth
        self.compact_below = compact_below
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

    # ---- sessions (the table is SessionEngine's; this engine adds each session's place in a KV group) -----------

    def _new_session(self) -> _Session:
        return _Session()

    def _detach(self, session: _Session) -> None:
        """Forget `session`'s cache (its row in the group becomes dead)."""
        if session.group is not None:
            session.group.session_ids[session.row] = None
        session.group, session.row, session.cached = None, -1, 0

    _release = _detach

    # ---- generation -----------------------------------------------------------------------------------------

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
        seeds = self._request_seeds(seeds, len(sessions))
        chunk = self.max_batch_size or max(len(sessions), 1)
        results: list[GenerationResult] = []
        with _eval_mode(self.model):
            for start in range(0, len(sessions), chunk):
                part = slice(start, start + chunk)
                results.extend(self._generate_batch(session_ids[part], sessions[part], params, seeds[part]))
        return results

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))

    def _generate_batch(
        self, session_ids: list[int], sessions: list[_Session], params: SamplingParams, seeds: list[int]
    ) -> list[GenerationResult]:
        if not self.reuse_kv:
            for session in sessions:
                self._detach(session)
        pending = [s.tokens[s.cached :] for s in sessions]
        try:
            group = self._group_for(session_ids, sessions, max(len(p) for p in pending) + params.max_new_tokens)
            logits = self.prefill(group, pending)
            uniforms = torch.from_numpy(request_uniforms(seeds, params.max_new_tokens)).to(self.device)
            tokens, logprobs, raw, counts, stopped_by = self.decode(group, logits, uniforms, params)
        except BaseException:
            for session in sessions:  # a half-updated cache must not be reused: re-prefill next time
                self._detach(session)
            raise
        stops = self._stop_ids(params)
        results = []
        for row, session in enumerate(sessions):
            n = int(counts[row])
            ids = tokens[row, :n].tolist()
            session.tokens.extend(ids)
            session.cached = len(session.tokens) - 1
            results.append(
                GenerationResult(
                    token_ids=ids,
                    logprobs=logprobs[row, :n].tolist(),
                    finish_reason="stop" if ids[-1] in stops or stopped_by[row] else "length",
                    raw_logprobs=raw[row, :n].tolist(),
                    weight_version=self._version,
                    stop_string=stopped_by[row],
                )
            )
        if not self.reuse_kv:
            for session in sessions:
                self._detach(session)
        return results

    def _group_for(self, session_ids: list[int], sessions: list[_Session], columns: int) -> _KVGroup:
        """The group to generate `sessions` in, with room for `columns` more columns: their current group when it
        holds exactly them in this order and is not too sparse, else a new compact group gathered from wherever
        their caches are."""
        group = sessions[0].group
        if group is not None and group.session_ids == session_ids and group.fill_ratio() >= self.compact_below:
            group.reserve(columns, self.growth)
            return group
        width = max(s.cached for s in sessions)
        new = _KVGroup(list(session_ids), self._shape, width + columns, self.dtype, self.device)
        new.set_length(width)
        cols = torch.arange(width, device=self.device)
        for row, session in enumerate(sessions):
            new.valid[row, :width] = cols >= width - session.cached
            new.next_pos[row] = session.cached
        sources: dict[int, tuple[_KVGroup, list[int], list[int]]] = {}
        for row, session in enumerate(sessions):
            if session.group is not None and session.cached > 0:
                sources.setdefault(id(session.group), (session.group, [], []))
                sources[id(session.group)][1].append(session.row)
                sources[id(session.group)][2].append(row)
        for src, src_rows, dst_rows in sources.values():
            self._copy_rows(src, src_rows, new, dst_rows, width)
        for row, session in enumerate(sessions):
            cached = session.cached
            self._detach(session)
            session.group, session.row, session.cached = new, row, cached
        return new

    @staticmethod
    def _copy_rows(src: _KVGroup, src_rows: list[int], dst: _KVGroup, dst_rows: list[int], width: int) -> None:
        """Copy the valid columns of `src_rows`, in order and right-aligned, into the first `width` columns of
        `dst_rows` (one gather per layer and tensor)."""
        device = src.valid.device
        rows = torch.tensor(src_rows, device=device)
        valid = src.valid[rows, : src.length]
        cols = torch.arange(src.length, device=device).expand_as(valid)
        key = torch.where(valid, cols, -1)  # invalid columns sort first, valid ones keep their order
        if src.length < width:
            key = torch.nn.functional.pad(key, (width - src.length, 0), value=-1)
        index = key.sort(dim=1).values[:, key.shape[1] - width :].clamp(min=0)  # [m, width]
        targets = torch.tensor(dst_rows, device=device)
        for src_layer, dst_layer in zip(src.layers, dst.layers, strict=True):
            for name in ("keys", "values"):
                source = getattr(src_layer, name).transpose(1, 2)  # [B, C, kv_heads, head_dim] view
                picked = source[rows[:, None], index]  # [m, width, kv_heads, head_dim]
                getattr(dst_layer, name)[targets, :, :width] = picked.transpose(1, 2)

    def _forward(self, group: _KVGroup, input_ids: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
        """Run the model on [B, n] new columns of `group`; returns the last column's logits [B, V]."""
        start, n = group.length, input_ids.shape[1]
        group.valid[:, start : start + n] = new_valid
        positions = (group.next_pos[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids,
            attention_mask=group.valid[:, : start + n],
            position_ids=positions,
            past_key_values=group.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        group.next_pos += new_valid.sum(dim=1)
        return out.logits[:, -1]

    def prefill(self, group: _KVGroup, pending: list[list[int]]) -> torch.Tensor:
        """Feed each row's uncached tokens (left-padded to one [B, P] chunk, split into column chunks of at most
        ``max_prefill_tokens // B``); returns the logits [B, V] that predict each row's next token.

        Shared prompts: when the group is fresh (nothing cached) and rows repeat the same prompt (a GRPO group's
        rollouts start from one initial state), each distinct prompt is computed once in a smaller group and its
        KV columns are copied to every row that has it (the same numbers, up to the float differences a different
        batch size may give)."""
        if group.length > 0:  # rows with cached history: their contexts differ even when the new tokens agree
            return self._prefill_rows(group, pending)
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(p), len(distinct)) for p in pending]
        if len(distinct) < len(pending):
            small = _KVGroup(list(range(len(distinct))), self._shape, group.capacity, self.dtype, self.device)
            logits = self._prefill_rows(small, [list(p) for p in distinct])
            rows = torch.tensor(index, dtype=torch.long, device=self.device)
            used = small.length
            for mine, theirs in zip(group.layers, small.layers, strict=True):
                mine.keys[:, :, :used].copy_(theirs.keys[rows, :, :used])
                mine.values[:, :, :used].copy_(theirs.values[rows, :, :used])
            group.valid[:, :used] = small.valid[rows, :used]
            group.next_pos.copy_(small.next_pos[rows])
            group.set_length(used)
            return logits[rows]
        return self._prefill_rows(group, pending)

    def _prefill_rows(self, group: _KVGroup, pending: list[list[int]]) -> torch.Tensor:
        rows, width = len(pending), max(len(p) for p in pending)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        new_valid = torch.zeros(rows, width, dtype=torch.bool)
        for row, ids in enumerate(pending):
            if ids:
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                new_valid[row, width - len(ids) :] = True
        input_ids, new_valid = input_ids.to(self.device), new_valid.to(self.device)
        step = max(1, self.max_prefill_tokens // rows)
        logits = None
        for start in range(0, width, step):
            logits = self._forward(group, input_ids[:, start : start + step], new_valid[:, start : start + step])
        return logits

    def decode_one_token(self, group: _KVGroup, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] int64; rows where `active` is False get a masked pad); returns logits [B, V]."""
        fed = torch.where(active, tokens, self.pad_token_id)
        return self._forward(group, fed[:, None], active[:, None])

    def decode(
        self, group: _KVGroup, logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        """Sample until every row stopped or hit max_new_tokens.

        Returns tokens [B, S] int64, logprobs [B, S] fp32, raw logprobs [B, S] fp32 (S <= max_new_tokens; row b
        is valid up to counts[b]), counts [B] int64 and, per row, the ``params.stop`` string that ended it ("").
        """
        rows, steps = logits.shape[0], params.max_new_tokens
        stops = torch.tensor(sorted(self._stop_ids(params)), dtype=torch.long, device=self.device)
        tokens = torch.zeros(rows, steps, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=self.device)
        raw = torch.zeros_like(logprobs)
        counts = torch.zeros(rows, dtype=torch.long, device=self.device)
        active = torch.ones(rows, dtype=torch.bool, device=self.device)
        matcher = stop_matcher(self._stop_matchers, self.tokenizer, params.stop, self.vocab_size)
        history: list[list[int]] = [[] for _ in range(rows)]
        stopped_by = [""] * rows
        for step in range(steps):
            tok, lp, rlp = sample_tokens(logits, uniforms[:, step], params.temperature, params.top_k, params.top_p)
            tokens[:, step], logprobs[:, step], raw[:, step] = tok, lp, rlp
            counts += active
            active = active & ~torch.isin(tok, stops)
            if matcher is not None:
                was_active = active.tolist()
                for row, t in enumerate(tok.tolist()):
                    if not was_active[row]:
                        continue
                    history[row].append(t)
                    hit = matcher.match(history[row])
                    if hit:
                        stopped_by[row] = hit
                        active[row] = False
            if step == steps - 1 or not bool(active.any()):
                break
            logits = self.decode_one_token(group, tok, active)
        width = int(counts.max())
        return tokens[:, :width].cpu(), logprobs[:, :width].cpu(), raw[:, :width].cpu(), counts.cpu(), stopped_by

    # ---- weights --------------------------------------------------------------------------------------------

    def sync_weights(self, state_dict_or_model: Mapping[str, Any] | nn.Module) -> int:
        """Copy new weights into the engine's model (a no-op copy when given the engine's own module) and drop all
        caches. Accepts a module (peft-wrapped modules: merge the adapter first) or a state dict whose tensors may
        be DTensors (gathered with ``full_tensor``). Returns the new weight_version."""
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
        for session in self._sessions.values():
            self._detach(session)
        self._version += 1
        return self._version

    def _tied(self) -> bool:
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return head is not None and embed is not None and head.weight is embed.weight

    def close(self) -> None:
        self._close_all_sessions()
