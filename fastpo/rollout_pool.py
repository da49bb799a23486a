"""Partial rollouts across iterations (``rollout.partial``): episodes that outlive the iteration that started them.

    pool = RolloutPool(parts, engine, tokenizer, sampling, cfg, source=next_group, width=64)
    batches, stats = pool.run(target=8)      # one iteration's rollout: 8 finished groups
    ...                                      # train on batches, push the weights (the engine's version moves on)
    engine.sync_weights(policy, keep_cache=True)   # rollout.partial_kv keep (built-in engine); else keep_cache=False
    pool.close()

The pool keeps up to ``width`` episodes in flight. It starts groups in the order ``source(0), source(1), ...`` gives
them, a whole group at a time, whenever the group fits, and at most one iteration ahead: ``target`` new groups per
call, plus ``target`` more before the first. So while the slowest episodes of one iteration still run, the next
iteration's groups have started. Each episode advances as in the asynchronous driver (``rollout.mode async``).

:meth:`RolloutPool.run` stops once ``target`` groups have finished and so has every group at the staleness bound;
the turns being generated then finish (no token is thrown away) and no new turn starts. The episodes' next turns
are sampled by the next call, under the weights pushed in between. With ``rollout.partial_interrupt`` the turns
being generated are cut at that point instead (``HFEngine.interrupt``: the call does not wait for the longest
answers in flight); the next call continues each from the tokens it has (``submit(..., resume=...)``), so one turn
may hold tokens of two versions, each recorded. A drain never cuts. A call returns ``target`` finished groups:
every group at the bound, then the oldest others (more only when more are at the bound); finished groups beyond
that wait for the next call. Every turn records the engine's ``weight_version`` (``Trajectory.versions``). A
group started at version v0 is returned at the latest by the call where the engine's version reaches
v0 + max_staleness, so no trained token lags the trained weights by more than that. ``drain`` (a checkpoint step):
every started group finishes and is returned, at most ``target`` new ones start, and the pool is left as a fresh
one (nothing in flight).

Between calls the episodes in flight sit between two turns, or in a cut turn (nothing is generating either way), so
a weight push never lands in the middle of a forward. What the push does to their KV cache is the caller's choice
(``rollout.partial_kv``): recompute drops it, and each carried episode re-prefills its whole context at its next
turn; keep leaves it, and the next turn prefills only its new tokens under the new weights
(``HFEngine.sync_weights(keep_cache=True)``). Either way a token records the version that sampled it; under keep
its context's cached keys / values may come from older versions (down to the version of the episode's first turn).
``PoolStats.engine.prefill_tokens`` shows the difference.

Batches: one ``RolloutBatch`` per part, groups in start order, members in instance order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import RolloutConfig
from .engine.base import EngineStats, SamplingParams, as_async
from .rollout import RolloutBatch, RolloutPart, _PartRun


@dataclass(frozen=True)
class NewGroup:
    """A group to start: its part (index into the pool's parts), env seed, group id (unique among the groups the
    pool holds: the trainer uses the env seed counter) and one request seed per member (the group's size)."""

    part: int
    seed: int
    group: int
    request_seeds: tuple[int, ...]


@dataclass
class PoolStats:
    """What one :meth:`RolloutPool.run` did.

    Attributes:
        started / finished: groups started / finished (and returned) in this call.
        carried: episodes still running after it (continued by the next call).
        tail_turns: turns that finished after the stop rule held: the call waits for the turns in flight (their
            tokens are never thrown away) and starts no new one.
        interrupted: turns cut at the stop rule instead (``rollout.partial_interrupt``): they continue in the next
            call under the new weights.
        held: finished groups kept for the next call (more finished than the batch takes).
        forced: groups that had to finish in this call (the staleness bound, or ``drain``).
        engine: the engine's counters over the call (``EngineStats.since``; all 0 when the engine keeps none):
            occupancy, ``prefill_tokens`` (the carried contexts' re-prefill included under ``rollout.partial_kv
            recompute``), and the forwards' seconds.
    """

    started: int = 0
    finished: int = 0
    carried: int = 0
    tail_turns: int = 0
    interrupted: int = 0
    held: int = 0
    forced: int = 0
    engine: EngineStats = field(default_factory=EngineStats)

    @staticmethod
    def combined(every: Sequence[PoolStats]) -> dict[str, float]:
        """``rollout/partial_*`` metrics (counts summed over `every`, e.g. the ranks' stats of one iteration) and the
        occupancy of their decode steps together (docs/LOGGING.md)."""
        out = {f"rollout/partial_{k}": float(sum(getattr(x, k) for x in every))
               for k in ("carried", "tail_turns", "interrupted", "forced", "started", "finished", "held")}
        total = functools.reduce(EngineStats.plus, (x.engine for x in every), EngineStats())
        out["rollout/partial_prefill_tokens"] = float(total.prefill_tokens)
        if total.row_steps:
            out["rollout/decode_occupancy"] = total.occupancy()
        if total.slot_steps:
            out["rollout/slot_occupancy"] = total.slot_occupancy()
        if every:  # per rank, as the drivers without partial rollouts log them
            out["rollout/prefill_s"] = total.prefill_s / len(every)
            out["rollout/decode_s"] = total.decode_s / len(every)
        return out


@dataclass
class _Group:
    part: int
    members: list[int]  # instance indices in the part's env
    version: int  # the engine version when it started (its oldest possible token)
    order: int  # start order (ties of the env seed never happen: the trainer's seeds are unique)
    running: set[int] = field(default_factory=set)  # members not finished yet


class RolloutPool:
    """Episodes of several env parts that live across iterations (see the module docstring).

    Args:
        parts: one ``RolloutPart`` per env; its env's ``num_envs`` is the most instances that part may hold at once
            (running, or finished and waiting for the rest of their group); ``seeds`` / ``group_ids`` /
            ``request_seeds`` are not used (groups come from ``source``).
        engine: the generation engine (its asynchronous interface, or the lock-step fallback).
        tokenizer, sampling, cfg: as ``run_rollouts``; ``cfg.max_staleness`` is the bound.
        source: ``source(n)`` is the n-th group to start (0-based; a pure function of n: the pool starts them in
            order, and :attr:`next_group` says where it is).
        width: episodes kept in flight (>= the largest group).
        next_group: the first n to start (a resumed run continues its sequence).
    """

    def __init__(self, parts: Sequence[RolloutPart], engine: Any, tokenizer: Any, sampling: SamplingParams,
                 cfg: RolloutConfig, source: Callable[[int], NewGroup], width: int, next_group: int = 0):
        if cfg.max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {cfg.max_staleness}")
        if width < 1:
            raise ValueError(f"width must be >= 1 episode, got {width}")
        self.cfg, self.sampling, self.engine = cfg, sampling, as_async(engine)
        if cfg.partial_interrupt and not callable(getattr(self.engine, "interrupt", None)):
            raise ValueError(f"rollout.partial_interrupt needs an engine that can interrupt its requests (the "
                             f"built-in one); {type(engine).__name__} cannot")
        self.source, self.width, self.next_group = source, width, next_group
        self.groups: dict[tuple[int, int], _Group] = {}
        self.resubmit: list[tuple[int, int]] = []  # episodes between turns at the end of the last call, in order
        self.cut: dict[tuple[int, int], Any] = {}  # episodes whose turn the last call interrupted: the turn so far
        self.held: list[tuple[int, int]] = []  # groups finished in an earlier call and not returned yet
        self._budget: int | None = None  # groups the source may still start (set by the first call)
        self.runs: list[_PartRun] = []
        try:
            for part in parts:
                n = part.env.num_envs
                part.env.reset(np.arange(n, dtype=np.int64))  # batch envs render only after every instance is reset
                self.runs.append(_PartRun(dataclasses.replace(part, seeds=[0] * n, group_ids=[0] * n,
                                                              request_seeds=[0] * n), cfg, engine, tokenizer,
                                          sampling, start=False))
        except BaseException:
            self.close()
            raise
        self.free = [list(range(p.env.num_envs)) for p in parts]
        self._queued: NewGroup | None = None  # source(next_group), drawn but not started (no room yet)
        self._owner: dict[tuple[int, int], tuple[int, int]] = {}  # (part, instance) -> its group's key

    def in_flight(self) -> int:
        """Episodes that have started and not finished."""
        return sum(len(g.running) for g in self.groups.values())

    def run(self, target: int, drain: bool = False) -> tuple[list[RolloutBatch], PoolStats]:
        """One iteration's rollout (see the module docstring): ``target`` finished groups, more when more are at the
        staleness bound, every one with ``drain`` (a checkpoint step: nothing stays in flight); fewer only when no
        group is left to finish and none may start."""
        if target < 1:
            raise ValueError(f"target must be >= 1 group, got {target}")
        engine, runs = self.engine, self.runs
        version = int(getattr(engine, "weight_version", 0))
        for r in runs:
            r.version = version
            r.timings = {k: 0.0 for k in r.timings}
        stats = PoolStats()
        before = dataclasses.replace(engine.stats) if hasattr(engine, "stats") else None
        forced = {key for key, g in self.groups.items() if drain or version - g.version >= self.cfg.max_staleness}
        stats.forced = len(forced)
        finished: list[tuple[int, int]] = list(self.held)  # finished in an earlier call, not returned yet
        first = self.next_group
        # the source may run one iteration ahead of what the calls take: target new groups per call, plus target
        # more before the first call (the lookahead that carries over); a drain resets it, as a fresh pool has it
        self._budget = (2 * target if self._budget is None else self._budget + target)
        try:
            stats.tail_turns, stats.interrupted = self._drive(version, forced, target, finished, drain)
        except BaseException:
            engine.abort()
            raise
        # the batch: every forced group, then the oldest others up to target; the rest wait for the next call (a
        # group that would then be at the bound is forced there). drain: everything.
        order = sorted(finished, key=lambda key: (key not in forced, self.groups[key].order))
        count = len(order) if drain else max(target, sum(1 for key in order if key in forced))
        taken, self.held = order[:count], order[count:]
        if drain:
            self._budget = None
        batches = self._collect(taken)
        stats.started, stats.finished, stats.carried = self.next_group - first, len(taken), self.in_flight()
        stats.held = len(self.held)
        if before is not None:
            stats.engine = engine.stats.since(before)
        return batches, stats

    def _start_next(self, version: int) -> list[tuple[int, int]]:
        """Start the next group of the source when it fits (width and free instances); returns its episodes
        (part, instance), or [] when it does not fit."""
        g = self._queued if self._queued is not None else self.source(self.next_group)
        self._queued = g
        if not 0 <= g.part < len(self.runs):
            raise ValueError(f"NewGroup.part must lie in [0, {len(self.runs)}), got {g.part}")
        size = len(g.request_seeds)
        if size < 1 or size > self.width:
            raise ValueError(f"a group of {size} episodes does not fit the pool's width ({self.width})")
        if size > self.runs[g.part].env.num_envs:
            raise ValueError(f"part {g.part} holds {self.runs[g.part].env.num_envs} env instances, fewer than a "
                             f"group of {size}")
        if (g.part, g.group) in self.groups:
            raise ValueError(f"group {g.group} of part {g.part} is still in the pool; group ids must be unique")
        if self.in_flight() + size > self.width or len(self.free[g.part]) < size:
            return []
        self.free[g.part].sort()
        members = [self.free[g.part].pop(0) for _ in range(size)]
        self.groups[(g.part, g.group)] = _Group(g.part, members, version, self.next_group, set(members))
        self._owner.update({(g.part, i): (g.part, g.group) for i in members})
        self.runs[g.part].start(members, [g.seed] * size, [g.group] * size, list(g.request_seeds))
        self.next_group += 1
        self._queued = None
        return [(g.part, i) for i in members]

    def _drive(self, version: int, forced: set[tuple[int, int]], target: int,
               finished: list[tuple[int, int]], drain: bool) -> tuple[int, int]:
        """Submit, step and absorb until the stop rule holds (module docstring); then let the turns in flight
        finish, or cut them (``rollout.partial_interrupt``, not on a drain). Returns (turns that finished after the
        stop rule held: the tail the iteration waited for, turns cut)."""
        engine, runs = self.engine, self.runs
        waiting = collections.deque(self.resubmit)  # the carried episodes first
        self.resubmit = []
        running: set[tuple[int, int]] = set()
        temp: dict[tuple[int, int], int] = {}  # non-KV requests: the one-request session opened for them
        started = [0]  # groups started in this call

        def submit(k: int, todo: list[int]) -> None:
            runs[k].submit(engine, k, todo, temp)
            running.update((k, i) for i in todo)

        def settle(k: int, indices: list[int]) -> None:
            """Episodes among `indices` that ended: free their sessions; a group whose members all ended is done."""
            runs[k].release(indices)
            for i in indices:
                key = self._owner[(k, i)]
                group = self.groups[key]
                if not runs[k].eps[i].active and i in group.running:
                    group.running.discard(i)
                    if not group.running:
                        finished.append(key)

        def stop() -> bool:
            done = set(finished)
            if drain:  # nothing stays in flight, and (as any call) one iteration's worth unless none may start
                return all(key in done for key in self.groups) and (
                    len(done) >= target or started[0] >= target or self._budget <= 0)
            return len(done) >= target and forced <= done

        def start_more() -> None:
            while not stop():
                if not waiting and self._budget > 0 and (not drain or started[0] < target):
                    new = self._start_next(version)
                    started[0] += bool(new)
                    self._budget -= bool(new)
                    waiting.extend(new)
                if not waiting:
                    return
                k, i = waiting.popleft()
                if (k, i) in self.cut:  # its turn was cut by the last call: continue it (nothing to prepare)
                    runs[k].resume(engine, k, i, self.cut.pop((k, i)))
                    running.add((k, i))
                    continue
                todo = runs[k].prepare([i])
                settle(k, [i])  # no turn fits the context cap: the episode ends here
                submit(k, todo)

        try:
            start_more()
            tail = cut = 0
            while engine.num_unfinished():
                closing = stop()  # the iteration is over: let the turns in flight finish, start no new one
                t0 = time.perf_counter()
                if closing and self.cfg.partial_interrupt and not drain:
                    # ... or cut them now: each continues in the next call from the tokens it has
                    done, kept = engine.interrupt(), []
                    for c in done:
                        if c.result.finish_reason == "interrupted":
                            self.cut[c.tag] = c.result
                            self.resubmit.append(c.tag)
                            running.discard(c.tag)
                        else:
                            kept.append(c)
                    cut += len(done) - len(kept)
                    done = kept
                else:
                    done = engine.step()
                spent = time.perf_counter() - t0
                for k, r in enumerate(runs):
                    r.timings["generate_s"] += spent * sum(1 for x in running if x[0] == k) / max(len(running), 1)
                by_part: dict[int, list] = {}
                for c in done:
                    k, i = c.tag
                    by_part.setdefault(k, []).append((i, c.result))
                    running.discard((k, i))
                    if (k, i) in temp:
                        engine.close_sessions([temp.pop((k, i))])
                for k, items in sorted(by_part.items()):
                    todo = [i for i, _ in items]
                    runs[k].absorb(todo, [res for _, res in items])
                    if closing:  # their next turns wait for the next call (and its weights)
                        tail += len(todo)
                        settle(k, todo)  # absorb ended those at the env's end, the budget or the turn cap
                        self.resubmit += [(k, i) for i in todo if runs[k].eps[i].active]
                        continue
                    following = runs[k].prepare(todo)
                    settle(k, todo)
                    submit(k, following)
                if not closing:
                    start_more()
            self.resubmit += list(waiting)  # not submitted yet (episodes ahead of them in line, or the width)
            return tail, cut
        finally:
            for sid in temp.values():
                engine.close_sessions([sid])

    def _collect(self, finished: list[tuple[int, int]]) -> list[RolloutBatch]:
        """The finished groups' trajectories per part (groups in start order), their instances freed."""
        batches = []
        for k, r in enumerate(self.runs):
            keys = sorted((key for key in finished if key[0] == k), key=lambda key: self.groups[key].order)
            indices = [i for key in keys for i in self.groups[key].members]
            batches.append(r.finish(indices))
            for key in keys:
                self.free[k] += self.groups.pop(key).members
        return batches

    def close(self) -> None:
        """Abort what runs and close every session."""
        if getattr(self, "groups", None) and self.in_flight():
            self.engine.abort()
        for r in self.runs:
            r.close()
        self.runs = []
