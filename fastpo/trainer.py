"""The StarPO / StarPO-S training loop (docs/SEMANTICS.md sections 4-8). One iteration (``Trainer.iteration``):

    rollout of this rank's env groups -> all-gather the trajectories -> StarPO-S filter (the same decision on every
    rank) -> score: old logprobs (+ reference logprobs, values) -> advantages -> critic update -> actor update ->
    weight sync into the engine; validation every val_every, checkpoint every save_every, one metrics row

    trainer = Trainer(cfg, dist_info)       # loads models, envs, engine; resumes per cfg.trainer.resume
    trainer.train()                         # raises TrainingAborted on a logprob-gap / non-finite-loss stop
    trainer.close()                         # final checkpoint + Hugging Face export (<run_dir>/hf)

Data parallelism: rank r owns the consecutive env groups ``shard_groups(env_groups, world, r)``; global group g runs
env seed ``c + g`` at the iteration whose seed counter is c, and per-request sampling seeds depend on (trainer.seed,
step, global trajectory index) only, so 1 and N ranks sample the same trajectories. Every rank then holds all of
them: the filter, the advantages (GAE whitening is over the whole batch) and the mini-batches are computed
identically everywhere, and rank r trains ``mini_batch[r::world]`` (a rank short of data repeats one micro-batch
with loss scale 0: FSDP2's collectives need the same count everywhere). The numerics are free functions in
``fastpo.update``; the micro-batch layouts are ``fastpo.microbatch``'s. Stops: the parity guard (the mean |engine
logp - trainer logp| right after a weight sync above trainer.logprob_gap_max) and optim.max_nonfinite_in_a_row
non-finite steps in a row; both raise :class:`TrainingAborted` and leave the last checkpoint as it was. Test hook:
``FASTPO_INJECT_NAN_AT=2,3`` multiplies the actor loss by NaN at those iterations (1-based).
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import algorithms, checkpoint, diagnostics, env_mix, envs, kernels, provenance, rollout_filter, update
from . import distributed as du
from .config import Config, config_hash, to_dict, to_json
from .engine.base import Engine, SamplingParams
from .engine.hf import HFEngine
from .fsdp import build_trained_models, full_state_dict
from .metrics import (
    EchoTrapMonitor,
    EchoTrapThresholds,
    MetricsLogger,
    PhaseTimer,
    data_metrics,
    generation_record,
    memory_metrics,
    pick_generations,
)
from .microbatch import MicroBatch, cat_tokens, pack, split_tokens, token_cost
from .model import is_lora, load_policy, load_tokenizer, merged_state_dict
from .model_path import resolve_model_path
from .objectives import ActorObjective, CriticObjective, actor_loss_components
from .rollout import RolloutPart, Trajectory, run_rollouts
from .rollout_metrics import combine_metric_sums, metric_sums
from .rollout_pool import NewGroup, PoolStats, RolloutPool
from .startup import prepare_run

logger = logging.getLogger(__name__)

#: Env var of the NaN-injection test hook: comma-separated 1-based iteration numbers.
INJECT_NAN_ENV = "FASTPO_INJECT_NAN_AT"


class TrainingAborted(RuntimeError):
    """A deliberate stop (weight-sync logprob gap, too many non-finite steps); the message says why."""


class RequestKind(enum.IntEnum):
    """Which rollout a sampling seed is for: part of the seed's key, so training and validation never share one.
    The values are in every checkpointed run's seeds: never renumber them."""

    TRAIN = 0
    VALIDATION = 1


#: A micro-batch token budget no trajectory reaches (a trajectory is at most rollout.max_model_len tokens, a few
#: thousand; 10**9 is beyond any context a model has): ``pack`` then puts a filler trajectory in one micro-batch.
WHOLE = 10**9


def request_seed(seed: int, kind: RequestKind, step: int, index: int, round: int = 0) -> int:
    """Sampling seed of trajectory `index` (global) at `step`: a function of these numbers only (not of the world
    size). ``kind``: a :class:`RequestKind`; ``round`` > 0: a refill round of dynamic sampling."""
    key = [seed, kind, step, index] + ([round] if round else [])
    return int(np.random.SeedSequence(key).generate_state(1, np.uint32)[0])


def _episodes(parts: list[env_mix.EnvPart]) -> int:
    """Episodes (engine sessions) this rank runs at once for `parts`: groups x group size, over the parts."""
    return sum(len(p.groups) * p.entry.group_size for p in parts)


def injected_nan_steps() -> set[int]:
    """Iterations (1-based) whose actor loss the ``FASTPO_INJECT_NAN_AT`` test hook makes NaN."""
    raw = os.environ.get(INJECT_NAN_ENV, "").strip()
    try:
        return {int(s) for s in raw.split(",") if s.strip()}
    except ValueError:
        raise ValueError(f"{INJECT_NAN_ENV} must be comma-separated iteration numbers, got {raw!r}") from None


class Trainer:
    """StarPO / StarPO-S trainer. Its checkpointed state: models, optimisers, schedulers and :meth:`state_dict`
    (step, env seed counter, non-finite counters, echo-trap history) plus per-rank RNG states."""

    #: RAGEN-2's collapse metrics (``trainer.collapse_every``), made at their first iteration.
    collapse: diagnostics.CollapseDetector | None = None

    def __init__(self, cfg: Config, info: du.DistInfo | None = None):
        """The run's start-up first, the one both ``python -m fastpo.train`` and a library user take
        (``fastpo.startup.prepare_run``: the config validated, the run directory checked, then locked and claimed;
        ConfigError before anything is written), then :meth:`_setup`. The lock is released by :meth:`close` (or
        :meth:`unlock`), and here when the set-up fails."""
        self.cfg, self.info = cfg, info or du.init()
        self._lock = prepare_run(cfg, self.info.world_size)
        try:
            self._setup(cfg)
        except BaseException:
            self.unlock()
            raise

    def unlock(self) -> None:
        """Release the run directory's lock (rank 0's; idempotent): :meth:`close` does it, and ``fastpo.train``'s
        ``main`` when training failed before the close."""
        if self._lock is not None:
            self._lock.release()

    def _setup(self, cfg: Config) -> None:
        """Everything ``__init__`` builds once the run is prepared: models, engine, envs, logger, resume."""
        self.rank, self.world, self.device = self.info.rank, self.info.world_size, self.info.device
        self.run_dir, self.config_hash = Path(cfg.trainer.run_dir), config_hash(cfg)
        if du.is_main():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(to_json(cfg) + "\n")
        du.barrier()
        du.seed_everything(cfg.trainer.seed, self.rank)
        if cfg.trainer.deterministic:
            du.set_deterministic(True)
        self.model_path = resolve_model_path(cfg.model.path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.models = build_trained_models(cfg, self.model_path, self.device)
        self.actor, self.critic, self.ref = self.models.actor, self.models.critic, self.models.ref
        self.use_ref = algorithms.needs_reference(cfg.algorithm)
        self._layout, self._token_cost = self.models.layout, token_cost(self.actor)
        e, r = cfg.env, cfg.rollout
        envs.load_plugins(e.plugins)  # every rank, before any env is built (validate did it on this rank)
        # partial rollouts: room for the episodes in flight, their finished group mates and the finished groups, and
        # for the spare episodes (a group starts whole, so up to a group less one more)
        mix = env_mix.resolve_mix(e, "train")
        spare = r.partial_spare + max(m.group_size for m in mix) - 1 if r.partial_spare else 0
        self.train_parts = env_mix.build_parts(mix, du.shard_groups(e.env_groups, self.world, self.rank), e.backend,
                                               r.enable_think, e.action_sep,
                                               capacity=r.max_staleness + 2 if r.partial else 1, extra=spare)
        self.val_parts = env_mix.build_parts(env_mix.resolve_mix(e, "val"), du.shard_groups(
            e.val_groups, self.world, self.rank), e.backend, r.enable_think, e.action_sep)
        self.engine = self._build_engine()  # after the parts: vLLM sizes its KV cache from their batch
        self.step, self.train_seed = 0, e.train_seed
        self.pool: RolloutPool | None = None  # rollout.partial: built at the first iteration
        self.partial_next = [0] * self.world  # per rank: the next group its pool starts (see _pool_group)
        self.nonfinite_in_a_row = self.nonfinite_total = self.critic_nonfinite_total = 0
        self.nan_steps = injected_nan_steps()
        self.empty_stop = rollout_filter.EmptyStop(cfg.algorithm.rollout_filter_empty_stop_steps)
        t = cfg.trainer
        self.trap = EchoTrapMonitor(EchoTrapThresholds(
            std_floor=t.min_in_group_std, entropy_rel_change=1.0 - t.entropy_drop_factor,
            entropy_jump_factor=t.entropy_jump_factor, grad_spike_k=t.grad_norm_spike_factor))
        # a run resumed from a checkpoint continues its W&B run (id in the run dir); a fresh start opens a new one
        wandb_resume = t.resume != "never" and (t.resume != "auto" or checkpoint.latest(self.run_dir) is not None)
        self.logger = MetricsLogger(self.run_dir, self.rank, console=t.log_console, jsonl=t.log_jsonl,
                                    tensorboard=t.log_tensorboard, wandb=t.log_wandb, project=t.wandb_project,
                                    run_name=t.run_name or None, config=to_dict(cfg), total_steps=t.iterations,
                                    wandb_resume=wandb_resume, metric_names=t.metric_names)
        self.timer = PhaseTimer(synchronize=self.device.type == "cuda")
        self.resumed_from = self._resume()
        if du.is_main():  # which code, libraries and ranks this launch ran with; a resume appends its own record
            provenance.append_launch(self.run_dir, provenance.launch_record(self.world, self.step))
        self.logger.start_progress(self.step)  # a resumed run's bar continues at its step, its ETA covers the rest
        self._sync_engine()

    def _build_engine(self) -> Engine:
        """This rank's generation engine (rollout.engine), holding its own full copy of the policy; weights are
        pushed after every update. vLLM: one in-process instance per rank for the rank's own groups; under torchrun
        it joins the existing process group as an independent replica (``external_launcher``, tensor parallel 1).
        The HF engine keeps the model's attention implementation (its KV slots need masks with holes); on CPU its
        forwards of grouped-KV models go through SDPA's GQA path (``fastpo.engine.attention``).
        vLLM sleeps at level 2 (every wake is a full weight push: nothing to keep on the host), and on GPU sizes
        its KV cache and step token budget from the rank's largest batch (train or validation sessions, at most
        rollout.max_num_seqs) unless rollout.kv_cache_mb is set. The built-in engine runs every request submitted
        to it at once; with rollout.partial_spare at most the training batch's slots (or validation's, if more), so
        the spare episodes wait in its queue."""
        cfg, r = self.cfg, self.cfg.rollout
        if r.engine == "vllm":
            from .engine.vllm import VLLMEngine

            sessions = max(_episodes(self.train_parts), _episodes(self.val_parts))
            return VLLMEngine(
                self.model_path, self.tokenizer, seed=cfg.trainer.seed + self.rank, dtype=cfg.model.dtype,
                kv_cache_bytes=r.kv_cache_mb * 2**20 if r.kv_cache_mb else None,
                max_num_seqs=max(1, min(sessions, r.max_num_seqs or sessions)),
                gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len,
                distributed_executor_backend="external_launcher" if self.world > 1 else None,
                tensor_parallel_size=1, sleep_level=2)
        engine_model = load_policy(self.model_path, dtype=cfg.model.dtype).to(self.device).eval()
        engine_model.requires_grad_(False)
        slots = None  # as many as are submitted
        if r.partial and r.partial_spare:  # the spare episodes queue for the training batch's slots
            slots = max(self._train_slots(), _episodes(self.val_parts))
        return HFEngine(engine_model, self.tokenizer, seed=cfg.trainer.seed + self.rank, max_batch_size=slots)

    def _train_slots(self) -> int:
        """The engine's batch slots for this rank's training rollout: rollout.max_num_seqs, or every episode."""
        return self.cfg.rollout.max_num_seqs or _episodes(self.train_parts)

    # ---- checkpoint state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The trainer's own resumable state (JSON-serialisable)."""
        return {
            "step": self.step, "train_seed": self.train_seed, "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total, "critic_nonfinite_total": self.critic_nonfinite_total,
            "weight_version": self.engine.weight_version, "partial_next": list(self.partial_next),
            "empty_filter_steps": self.empty_stop.count,
            "echo_trap": {"history": {k: list(v) for k, v in self.trap.history.items()},
                          "counts": dict(self.trap.counts), "iteration": self.trap.iteration},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.train_seed = int(state["step"]), int(state["train_seed"])
        self.nonfinite_in_a_row, self.nonfinite_total = int(state["nonfinite_in_a_row"]), int(state["nonfinite_total"])
        self.critic_nonfinite_total = int(state["critic_nonfinite_total"])
        self.partial_next = [int(x) for x in state.get("partial_next", [0] * self.world)]
        self.empty_stop.count = int(state.get("empty_filter_steps", 0))
        trap = state["echo_trap"]
        self.trap.history = {k: deque(v, maxlen=self.trap.t.window) for k, v in trap["history"].items()}
        self.trap.counts, self.trap.iteration = Counter(trap["counts"]), int(trap["iteration"])

    def _resume(self) -> str | None:
        state = checkpoint.resume(self.run_dir, self.models.stateful(), mode=self.cfg.trainer.resume,
                                  config_hash=self.config_hash)
        # metrics.jsonl keeps the rows up to the resumed step: the steps after it are replayed and logged again
        dropped = self.logger.truncate_after(-1 if state is None else int(state["step"]))
        if dropped:
            logger.info(f"metrics.jsonl: dropped {dropped} row(s) after step {-1 if state is None else state['step']} "
                      f"(replayed by this run)")
        if state is None:
            return None
        self.load_state_dict(state)
        logger.info(f"resumed from step {self.step} ({self.run_dir})")
        return str(self.step)

    def save(self) -> Path:
        """Checkpoint the current step (collective)."""
        return checkpoint.save(self.run_dir, self.step, self.models.stateful(), self.state_dict(),
                               keep_last=self.cfg.trainer.keep_checkpoints or None, config_hash=self.config_hash)

    def _sync_engine(self) -> None:
        """Push the actor's weights into the engine (collective under FSDP2: every rank calls it). vLLM gathers the
        sharded parameters one bucket at a time while it pushes them (the full model never exists twice on a rank;
        under LoRA each adapted weight is merged as its bucket goes); the HF engine takes a full state dict, and
        under rollout.partial_kv keep leaves the carried episodes' KV caches in place (a drained pool has none)."""
        with self.timer("sync"):
            if isinstance(self.engine, HFEngine):
                self.engine.sync_weights(full_state_dict(self.actor),
                                         keep_cache=self.cfg.rollout.partial_kv == "keep")
            else:
                state = self.actor.state_dict()
                self.engine.sync_weights(merged_state_dict(self.actor, state) if is_lora(self.actor) else state)

    # ---- rollout --------------------------------------------------------------------------------------------
    def _filter(self, trajs: list[Trajectory], target: int | None) -> tuple[torch.Tensor, dict[str, float]]:
        """keep bool [B] over the iteration's trajectories and the filter's metrics: the legacy StarPO-S filter
        (``algorithms.filter_groups``; ``target`` from dynamic sampling) or RAGEN-2's family
        (``rollout_filter.select_groups``), per ``algorithm.rollout_filter_strategy``."""
        a = self.cfg.algorithm
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        groups = torch.tensor([t.group for t in trajs], dtype=torch.int64)
        if a.rollout_filter_strategy == "legacy":
            return algorithms.filter_groups(rewards, groups, a.rollout_filter_ratio, a.rollout_filter_type, target)
        metric = rollout_filter.METRIC_ALIASES.get(a.rollout_filter_metric, a.rollout_filter_metric)
        reads_entropy = rollout_filter.FILTER_METRICS.get(metric, (None, ""))[1] == "entropies"
        return rollout_filter.select_groups(
            rewards, groups, strategy=a.rollout_filter_strategy, value=a.rollout_filter_value,
            metric=a.rollout_filter_metric, filter_type=a.rollout_filter_direction,
            include_zero=a.rollout_filter_include_zero, prob_mode=a.rollout_filter_top_p_prob_mode,
            selection_eps=a.rollout_filter_selection_eps,
            lengths=torch.tensor([float(t.loss_mask.sum()) for t in trajs], dtype=torch.float32),
            entropies=self._entropies(trajs) if reads_entropy else None)

    def _entropies(self, trajs: list[Trajectory]) -> Tensor:
        """fp32 [B]: each trajectory's mean token entropy of the actor (at the sampling temperature) over its trained
        tokens, 0 without any; the entropy filter metrics' input (RAGEN-2 runs the same forward over the whole
        batch before its filter). Collective, through :meth:`_score`."""
        idx = list(range(len(trajs)))
        scored = self._score(trajs, idx, extras=False, entropy=True)
        return torch.tensor([float(np.asarray(scored[i]["entropy"], dtype=np.float64).sum())
                             / max(float(np.count_nonzero(trajs[i].loss_mask)), 1.0) for i in idx], dtype=torch.float32)

    def _sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.response_length,
                              stop=tuple(r.stop))

    def _rollout(self, parts: list[env_mix.EnvPart], seed_base: int, kind: RequestKind, temperature: float, step: int,
                 prefix: str = "env", records: list | None = None,
                 round: int = 0) -> tuple[list[Trajectory], list[tuple[dict, dict]]]:
        """Every env part's episodes in one rollout (one engine call per turn for all of them); returns (this rank's
        trajectories, every rank's metric sums: ``combine_metric_sums`` makes them one dict). `step` feeds the
        request seeds (validation passes 0: the same sampling seeds every time). ``records``, when given, receives
        one generation record per trajectory of this rank (the validation's generations table). ``round`` > 0: a
        refill round (its own request seeds; group ids offset by round x env.env_groups, unique in the batch)."""
        jobs = []
        for part in parts:
            size = part.entry.group_size
            index = [first + j for first in part.first_index for j in range(size)]
            jobs.append(RolloutPart(
                part.env, part.spec, np.repeat([seed_base + g for g in part.groups], size),
                np.repeat([g + round * self.cfg.env.env_groups for g in part.groups], size),
                [request_seed(self.cfg.trainer.seed, kind, step, i, round) for i in index],
                max_turns=part.entry.max_turns, max_actions_per_turn=part.entry.max_actions_per_turn,
                label=part.entry.label, prefix=prefix))
        batches = run_rollouts(jobs, self.engine, self.tokenizer, self._sampling(temperature), self.cfg.rollout)
        trajs = [t for batch in batches for t in batch.trajectories]
        for t in trajs:
            t.messages = []  # for logging only: not sent to every rank
        if records is not None:
            for part, batch in zip(parts, batches, strict=True):
                records.extend(generation_record(self.tokenizer, part.entry.label, t) for t in batch.trajectories)
        return trajs, du.all_gather_list([metric_sums(batches)])

    def _train_rollout(self) -> tuple[list[Trajectory], dict[str, float], int | None]:
        """This iteration's trajectories of every rank, the rollout metrics and the number of groups the filter
        is to keep (None: its own rule). Dynamic sampling (``algorithm.refill_rounds``): while fewer than
        int(ratio x env_groups) groups have a non-zero reward std, another round of env_groups new groups
        (fresh env seeds) joins the batch; ``rollout/refill_rounds`` counts them. Partial rollouts: the pool."""
        cfg, a = self.cfg, self.cfg.algorithm
        if cfg.rollout.partial:
            return self._partial_rollout()
        target = int(a.rollout_filter_ratio * cfg.env.env_groups + 1e-9)  # the filter's count (RAGEN's rule)
        trajs, sums, rounds = [], [], 0
        while True:
            local, part = self._rollout(self.train_parts, self.train_seed, RequestKind.TRAIN,
                                        cfg.rollout.temperature, self.step, round=rounds)
            trajs += du.all_gather_list(local)
            sums += part
            self.train_seed += cfg.env.env_groups
            if not a.refill_rounds or rounds >= a.refill_rounds:
                break
            _, _, std, _, _ = algorithms.group_stats(torch.tensor([t.reward for t in trajs], dtype=torch.float32),
                                                     torch.tensor([t.group for t in trajs], dtype=torch.int64))
            if int((std > 0).sum()) >= target:
                break
            rounds += 1
        metrics = combine_metric_sums(sums)
        if a.refill_rounds:
            metrics["rollout/refill_rounds"] = float(rounds)
        return trajs, metrics, (max(target, 1) if a.refill_rounds else None)

    def _pool_group(self, n: int) -> NewGroup:
        """The n-th group this rank's partial-rollout pool starts: the rank's groups of iteration c + 1 in the order
        the synchronous rollout runs them (c = n // groups per rank), with that iteration's env seeds and request
        seeds; its group id c x env_groups + g is unique in the pool."""
        shard = [(k, g, first) for k, part in enumerate(self.train_parts)
                 for g, first in zip(part.groups, part.first_index, strict=True)]
        c, (k, g, first) = n // len(shard), shard[n % len(shard)]
        size = self.train_parts[k].entry.group_size
        return NewGroup(k, self.cfg.env.train_seed + c * self.cfg.env.env_groups + g,
                        c * self.cfg.env.env_groups + g,
                        tuple(request_seed(self.cfg.trainer.seed, RequestKind.TRAIN, c + 1, first + j)
                              for j in range(size)))

    def _partial_rollout(self) -> tuple[list[Trajectory], dict[str, float], None]:
        """``rollout.partial``: one call of the rank's pool (``fastpo.rollout_pool``), as many finished groups as
        the rank runs per iteration; checkpoint steps and the last step drain it. Adds the pool's counters
        (summed over ranks) and the staleness of the returned tokens."""
        cfg, t = self.cfg, self.cfg.trainer
        per_rank = sum(len(p.groups) for p in self.train_parts)
        if self.pool is None:
            width = self._train_slots() + cfg.rollout.partial_spare
            self.pool = RolloutPool(
                [RolloutPart(p.env, p.spec, [], [], max_turns=p.entry.max_turns,
                             max_actions_per_turn=p.entry.max_actions_per_turn, label=p.entry.label)
                 for p in self.train_parts], self.engine, self.tokenizer, self._sampling(cfg.rollout.temperature),
                cfg.rollout, self._pool_group, width, next_group=self.partial_next[self.rank])
        drain = bool(t.save_every and self.step % t.save_every == 0) or self.step >= t.iterations
        batches, stats = self.pool.run(per_rank, drain=drain)
        local = [tr for b in batches for tr in b.trajectories]
        for tr in local:
            tr.messages = []
        self.partial_next = [int(x) for x in du.all_gather_list([self.pool.next_group])]
        gathered = du.all_gather_list([(metric_sums(batches), stats)])
        metrics = combine_metric_sums([g[0] for g in gathered])
        metrics.update(PoolStats.combined([g[1] for g in gathered]))
        return du.all_gather_list(local), metrics, None

    def validate(self) -> dict[str, float]:
        """Fixed-seed validation (env.val_seed, rollout.val_temperature): ``val-env/<Env>/...`` metrics; logs
        trainer.log_generations sampled generations at the current step (collective)."""
        n = self.cfg.trainer.log_generations
        records: list | None = [] if n > 0 else None
        with self.timer("validate"):
            _, sums = self._rollout(self.val_parts, self.cfg.env.val_seed, RequestKind.VALIDATION,
                                    self.cfg.rollout.val_temperature, 0, "val-env", records)
            metrics = combine_metric_sums(sums)
            if records is not None:
                self.logger.log_generations(self.step, pick_generations(du.all_gather_list(records), n))
        return {k: v for k, v in metrics.items() if k.startswith("val-env/")}

    # ---- scoring and update ---------------------------------------------------------------------------------
    def _micro_batches(self, trajs: list[Trajectory], mini_batch: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches of one mini-batch with their loss scales, padded with scale-0 repeats to the
        same count on every rank."""
        mine = mini_batch[self.rank::self.world]
        micro = pack(trajs, mine, self.cfg.optim.micro_batch_tokens, self.device, self._layout, self._token_cost)
        for mb, scale in zip(micro, update.loss_scales(trajs, mini_batch, micro, self.cfg.algorithm.loss_agg_mode,
                                                       self.world), strict=True):
            mb.scale = scale
        count = int(du.all_reduce_max(len(micro)))  # once: every rank runs the same number of collectives
        while len(micro) < count:
            filler = pack(trajs, (mine or mini_batch)[:1], WHOLE, self.device, self._layout, self._token_cost)[0]
            filler.scale = 0.0
            micro.append(filler)
        return micro

    @torch.no_grad()
    def _score(self, trajs: list[Trajectory], kept: list[int], actor: bool = True,
               extras: bool = True, entropy: bool = False) -> dict[int, dict[str, np.ndarray]]:
        """Old logprobs (and reference logprobs / values) of the trajectories ``kept`` (indices into ``trajs``):
        each rank computes kept[r::world], then all ranks exchange them. Returns index -> {"old_logp", "ref_logp",
        "values"} (fp32 [T] each, 0 off the trained tokens), on every rank; ``trajs`` are not changed.
        ``actor=False`` skips the old logprobs (they come from the update's forward or the sampler:
        ``update.old_logprob_source``); ``extras=False`` skips the reference logprobs and values; ``entropy`` adds
        the actor's per-token "entropy" (with ``actor``)."""
        use_ref, critic = self.use_ref and extras, self.critic is not None and extras
        if not actor and not use_ref and not critic:
            return {}
        mine, results = kept[self.rank::self.world], []
        micro = pack(trajs, mine, self.cfg.optim.micro_batch_tokens, self.device, self._layout, self._token_cost)
        temperature = self.cfg.rollout.temperature
        for k in range(int(du.all_reduce_max(len(micro)))):
            mb = micro[k] if k < len(micro) else pack(trajs, kept[:1], WHOLE, self.device, self._layout,
                                                      self._token_cost)[0]
            mask = cat_tokens(trajs, mb.indices, "loss_mask", self.device)
            out = {}
            if actor and entropy:
                out["old_logp"], out["entropy"] = update.token_logp(self.actor, mb, mask, temperature, True)
            elif actor:
                out["old_logp"] = update.token_logp(self.actor, mb, mask, temperature, False)
            if use_ref:
                out["ref_logp"] = self._ref_logp(mb, mask)
            if critic:
                # verl's GAE reads the values of observation tokens too: compute them over the response span
                vmask = mask if self.cfg.algorithm.gae_skip_observations else kernels.reference.response_span(
                    mask, mb.cu_seqlens)
                out["values"] = update.token_values(self.critic, mb, vmask)
            if k < len(micro):
                per = {f: split_tokens(v, mb.cu_seqlens) for f, v in out.items()}
                results += [(i, {f: per[f][j] for f in per}) for j, i in enumerate(mb.indices)]
        return dict(du.all_gather_list(results))

    def _sequence_logps(self, seqs: list[tuple[np.ndarray, np.ndarray, int]]) -> list[float]:
        """The actor's summed logprob of each sequence's masked tokens, for (input_ids, loss_mask, group) each
        (collective: :meth:`_score` on throwaway trajectories; the collapse diagnostics)."""
        trajs = [Trajectory(input_ids=ids, loss_mask=mask, group=group) for ids, mask, group in seqs]
        scored = self._score(trajs, list(range(len(trajs))), extras=False)
        return [float(np.sum(scored[i]["old_logp"], dtype=np.float64)) for i in range(len(trajs))]

    def _ref_logp(self, mb: MicroBatch, mask: Tensor) -> Tensor:
        """Reference-policy logp: the reference model, or under LoRA the actor with its adapter disabled."""
        if self.ref is not None:
            return update.token_logp(self.ref, mb, mask, self.cfg.rollout.temperature, False)
        with self.actor.disable_adapter():
            return update.token_logp(self.actor, mb, mask, self.cfg.rollout.temperature, False)

    def _check_gap(self, gap: dict[str, float]) -> None:
        """The parity guard: abort when the engine did not sample from the weights the trainer holds."""
        if gap and gap["rollout/logprob_gap_mean"] > self.cfg.trainer.logprob_gap_max:
            raise TrainingAborted(
                f"step {self.step}: mean |engine logp - trainer logp| = {gap['rollout/logprob_gap_mean']:.4g} right "
                f"after weight sync {self.engine.weight_version} exceeds trainer.logprob_gap_max="
                f"{self.cfg.trainer.logprob_gap_max}: the engine is not sampling from the trained weights")

    def _fit(self, trajs: list[Trajectory], kept: list[int], objective: ActorObjective | CriticObjective,
             model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any) -> dict[str, float]:
        """The one training loop of the actor and the critic: ppo_epochs over shuffled mini-batches of the kept
        trajectories, each an optimiser step over this rank's micro-batches of ``objective``'s loss (scaled so the
        accumulated gradient is one loss over the mini-batch); returns the update's metrics."""
        o, critic = self.cfg.optim, objective.name == "critic"
        sums, norms, steps = {}, [], 0
        for epoch in range(o.ppo_epochs):
            for mini in update.mini_batches(kept, o.mini_batch_size, o.shuffle_mini_batches, self.cfg.trainer.seed,
                                            self.step, epoch):
                loss_sum, micro = 0.0, self._micro_batches(trajs, mini)
                for j, mb in enumerate(micro):
                    if o.defer_grad_sync:
                        update.set_grad_sync(model, j == len(micro) - 1)
                    loss, m = objective(mb, cat_tokens(trajs, mb.indices, "loss_mask", self.device), steps)
                    (loss * mb.scale).backward()
                    loss_sum += float(loss.detach()) * mb.scale
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * mb.scale / self.world
                objective.before_step(steps)
                norm, ok = update.clip_and_step(model, optim, sched, loss_sum, o.grad_clip)
                norms.append(norm)
                steps += 1
                self._count_step(ok, critic, loss_sum, norm)
        out = update.metric_means(sums, self.world, steps)
        out.update(objective.finish())
        out.update({f"{objective.name}/grad_norm": float(np.mean(norms)),
                    f"{objective.name}/nonfinite_skips": self.critic_nonfinite_total if critic else
                    self.nonfinite_total})
        if not critic:
            out["actor/lr"] = sched.get_last_lr()[0]
        return out

    def _update(self, trajs: list[Trajectory], kept: list[int], source: str,
                prior_gap: tuple[float, int, float] = (0.0, 0, 0.0)) -> dict[str, float]:
        """The critic's update (when there is a critic), then the actor's, through ``_fit``. ``source``: where the
        actor's old logprobs come from (``update.old_logprob_source``). Where no scoring pass measured the logprob
        gap of every row ("update", "sampler", "first-update"), the actor's first optimiser step measures it and
        runs the parity guard before the weights move; with ``algorithm.offpolicy_correction`` each token's clipped
        term is weighed by the trainer-vs-sampler ratio (``algorithms.offpolicy_weights``). ``prior_gap``: the gap
        sums of the rows a scoring pass measured ("first-update"; ``update.gap_sums``), judged with the first
        step's."""
        m, norm_len, metrics = self.models, update.norm_len(trajs, kept), {}
        if self.critic is not None:
            metrics.update(self._fit(trajs, kept, CriticObjective(self.critic, trajs, self.cfg, self.device, norm_len),
                                     self.critic, m.critic_optim, m.critic_sched))
        actor = ActorObjective(
            self.actor, trajs, self.cfg, self.device, norm_len, source, self.engine.weight_version,
            self._ref_logp if self.use_ref else None, self._check_gap, inject_nan=self.step in self.nan_steps,
            prior_gap=prior_gap)
        metrics.update(self._fit(trajs, kept, actor, self.actor, m.actor_optim, m.actor_sched))
        return metrics

    def _gradient_analysis(self, trajs: list[Trajectory], kept: list[int], source: str) -> dict[str, float]:
        """RAGEN-2's gradient analysis (``trainer.gradient_analysis_every``; collective): the kept groups in
        reward-std buckets (``diagnostics.rv_buckets``, plus "all"), and per bucket each loss term's gradient norm
        (``objectives.actor_loss_components``) averaged over its mini-batches, without a step: the weights and the
        optimiser state stay as they were, the gradients are cleared. Keys ``grad_norm/<bucket>/...`` (docs/LOGGING.md);
        the "all" bucket's norms and losses also as ``actor/grad_norm/<term>``, ``actor/loss/<term>``."""
        t = self.cfg.trainer
        groups = diagnostics.group_rv_rows([trajs[j].reward for j in kept], [trajs[j].group for j in kept],
                                           [True] * len(kept))
        std_of = {g["group_id"]: g["reward_std"] for g in groups}
        buckets = diagnostics.rv_buckets([g["reward_std"] for g in groups], t.gradient_analysis_num_buckets,
                                         t.gradient_analysis_bucket_mode)
        norm_len, out = update.norm_len(trajs, kept), {}
        for name, members in buckets.items():
            ids = {groups[k]["group_id"] for k in members}
            idx = [j for j in kept if trajs[j].group in ids]
            if not idx:  # an empty fixed_rv bucket: nothing to measure (RAGEN skips it too)
                continue
            stds, pre = [std_of[trajs[j].group] for j in idx], f"grad_norm/{name}/"
            out.update({pre + "sample_count": float(len(idx)), pre + "sample_pct": len(idx) / len(kept),
                        pre + "reward_std_mean": float(np.mean(stds)), pre + "reward_std_min": min(stds),
                        pre + "reward_std_max": max(stds)})
            norms, losses = self._term_gradients(trajs, idx, source, norm_len)
            tokens = float(sum(int(trajs[j].loss_mask.sum()) for j in idx))
            for term, norm in norms.items():
                out.update({pre + term: norm, f"{pre}per_sample/{term}": norm / len(idx)})
                if tokens:
                    out[f"{pre}per_token/{term}"] = norm / tokens
            out.update({f"{pre}loss/{k}": v for k, v in losses.items()})
            if name == "all":
                out.update({f"actor/grad_norm/{k}": v for k, v in norms.items()})
                out.update({f"actor/loss/{k}": v for k, v in losses.items()})
        return out

    def _term_gradients(self, trajs: list[Trajectory], idx: list[int], source: str,
                        norm_len: float) -> tuple[dict[str, float], dict[str, float]]:
        """Per loss term, the actor's gradient norm over each mini-batch of ``idx`` (in order, one pass), averaged;
        and the terms' mini-batch losses averaged (policy, entropy, kl, total). Gradients cleared after each."""
        a, o, dev = self.cfg.algorithm, self.cfg.optim, self.device
        terms = ["task"] + ["entropy"] * (a.entropy_coef != 0) + ["kl"] * (self.use_ref and a.kl_coef != 0)
        norms: dict[str, list[float]] = {term: [] for term in terms}
        losses = dict.fromkeys(terms, 0.0)
        minis = [idx[i:i + o.mini_batch_size] for i in range(0, len(idx), o.mini_batch_size)]
        optim = self.models.actor_optim
        for mini in minis:
            micro = self._micro_batches(trajs, mini)
            for term in terms:
                optim.zero_grad(set_to_none=True)
                total = 0.0
                for j, mb in enumerate(micro):
                    if o.defer_grad_sync:
                        update.set_grad_sync(self.actor, j == len(micro) - 1)
                    mask = cat_tokens(trajs, mb.indices, "loss_mask", dev)
                    logp, ent = update.token_logp(self.actor, mb, mask, self.cfg.rollout.temperature, True)
                    old = logp.detach() if source == "update" else cat_tokens(trajs, mb.indices, "old_logp", dev)
                    loss = actor_loss_components(
                        logp, ent, old, cat_tokens(trajs, mb.indices, "advantages", dev), mask,
                        self._ref_logp(mb, mask) if term == "kl" else None, a, cu_seqlens=mb.cu_seqlens,
                        norm_len=norm_len)[term]
                    (loss * mb.scale).backward()
                    total += float(loss.detach()) * mb.scale
                norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), float("inf"))
                norms[term].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                losses[term] += du.all_reduce_sum([total])[0] / self.world  # the scales sum to the world size
            optim.zero_grad(set_to_none=True)
        names = {"task": "policy", "entropy": "entropy", "kl": "kl"}
        mean_losses = {names[term]: v / len(minis) for term, v in losses.items()}
        mean_losses["total"] = sum(mean_losses.values())
        return {term: float(np.mean(v)) for term, v in norms.items()}, mean_losses

    def _count_step(self, ok: bool, critic: bool, loss_sum: float, norm: float) -> None:
        """Count a skipped (non-finite) step; the actor's stop after optim.max_nonfinite_in_a_row of them."""
        if critic:
            self.critic_nonfinite_total += not ok
            return
        if ok:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        logger.info(f"step {self.step}: non-finite actor loss / grad norm ({loss_sum}, {norm}); optimiser step skipped "
                  f"({self.nonfinite_in_a_row} in a row)")
        limit = self.cfg.optim.max_nonfinite_in_a_row
        if self.nonfinite_in_a_row >= limit:
            last = checkpoint.latest(self.run_dir)
            raise TrainingAborted(f"{self.nonfinite_in_a_row} consecutive optimiser steps with a non-finite loss or "
                                  f"grad norm (optim.max_nonfinite_in_a_row={limit}) at step {self.step}; stopping. "
                                  f"Last checkpoint: {last if last else 'none'} (left intact)")

    # ---- the loop -------------------------------------------------------------------------------------------
    def iteration(self) -> dict[str, float]:
        """One training iteration (self.step is the 1-based number of the iteration being run)."""
        cfg = self.cfg
        with self.timer("generate"):
            trajs, metrics, target = self._train_rollout()
        if not any(t.loss_mask.any() for t in trajs):  # every rank holds all trajectories: all stop together
            raise TrainingAborted(
                f"iteration {self.step}: no trajectory has a trained token (mean turns per episode "
                f"{metrics.get('rollout/num_turns', 0.0):g}): the prompts leave no room for rollout.response_length "
                f"({cfg.rollout.response_length}) within rollout.max_model_len ({cfg.rollout.max_model_len})")
        if diagnostics.collapse_due(cfg.trainer, self.step):  # RAGEN-2's: on the whole rollout, before the filter
            self.collapse = self.collapse or diagnostics.CollapseDetector(cfg)
            with self.timer("collapse"):
                metrics.update(self.collapse(trajs, self.tokenizer, self._sequence_logps, self.step))
        keep, filter_metrics = self._filter(trajs, target)
        metrics.update(filter_metrics)
        if cfg.trainer.log_group_rv_table:
            self.logger.log_group_rv(self.step, diagnostics.group_rv_rows([t.reward for t in trajs],
                                                                          [t.group for t in trajs], keep.tolist()))
        kept = keep.nonzero().squeeze(-1).tolist()
        metrics["rollout/kept_trajectories"] = float(len(kept))
        if cfg.rollout.partial:
            metrics.update(update.staleness(trajs, kept, self.engine.weight_version))
        if self.empty_stop.update(bool(kept)):
            raise TrainingAborted(f"iteration {self.step}: the rollout filter kept no group in "
                                  f"{self.empty_stop.count} iterations in a row (algorithm."
                                  f"rollout_filter_empty_stop_steps={self.empty_stop.steps})")
        episodes = trajs
        if cfg.rollout.context_window_mode != "full":  # the filter chose episodes; their turns are what trains
            trajs, kept = update.turn_samples(episodes, kept)
            metrics["rollout/kept_turn_sequences"] = float(len(kept))
        if kept and cfg.algorithm.batch_adjust_mode != "none":  # RAGEN-2's batch_adjust_mode, after the empty check
            divisor = math.lcm(cfg.env.env_groups, cfg.optim.mini_batch_size, self.world)
            rng = np.random.default_rng([cfg.trainer.seed, rollout_filter.ADJUST_STREAM, self.step])
            kept = rollout_filter.adjust_batch(kept, divisor, cfg.algorithm.batch_adjust_mode, rng)
            metrics["rollout/adjusted_batch_size"] = float(len(kept))
        if not kept:
            logger.info(f"step {self.step}: no trajectory left to train (the rollout filter kept no group, or "
                        f"batch_adjust_mode delete dropped all); update skipped")
            return metrics
        # from here on one value, the iteration's batch: the kept trajectories (positions 0..K-1), each phase
        # returning new trajectories with its fields added; the rollout's own are never written
        batch, rows = [trajs[i] for i in kept], list(range(len(kept)))
        self.engine.sleep()  # GPU vLLM: free its memory for the update; _sync_engine wakes it (else a no-op)
        analysis = diagnostics.gradient_analysis_due(cfg.trainer, self.step)  # it needs every row's old logprobs
        source = update.old_logprob_source(rows, cfg.optim, cfg.algorithm, every_row=analysis)
        gap_args = (cfg.rollout.train_on_observations, self.engine.weight_version)
        whole = cfg.rollout.partial_kv == "keep"
        prior_gap = (0.0, 0, 0.0)
        with self.timer("score"):
            scored = self._score(batch, rows, actor=source == "trainer")
            rest = []  # the rows whose old logprobs a scoring pass of the actor computes besides
            if source == "sampler":  # the sampler's logprobs are the old logprobs; score only where they are not exact
                old, rest = update.take_engine_logprobs(batch, rows)
                for j, v in old.items():
                    scored.setdefault(j, {})["old_logp"] = v
            elif source == "first-update":  # the first mini-batch's come from the update's first forward
                first = set(update.first_mini_batch(rows, cfg.optim, cfg.trainer.seed, self.step))
                rest = [j for j in rows if j not in first]
            for j, f in (self._score(batch, rest, actor=True, extras=False) if rest else {}).items():
                scored.setdefault(j, {}).update(f)
            batch = update.with_fields(batch, scored)
        if source == "trainer":  # else the actor update measures the gap on its first forward
            gap = update.logprob_gap(batch, rows, *gap_args, whole_context=whole)
            metrics.update(gap)
            self._check_gap(gap)
        elif source == "first-update":  # the guard judges these with the first step's rows, before any step
            prior_gap = update.gap_sums(batch, rest, *gap_args, whole_context=whole)
        with self.timer("update"):
            adv, ret, adv_metrics = update.advantages(batch, rows, cfg.algorithm, self.critic is not None)
            scale = rollout_filter.filter_loss_scale(metrics["rollout/kept_group_fraction"],
                                                     cfg.algorithm.filter_loss_scaling)
            adv = adv if scale == 1.0 else [a * np.float32(scale) for a in adv]  # the critic's returns stay
            batch = update.with_fields(batch, {j: {"advantages": adv[j], "returns": None if ret is None else ret[j]}
                                               for j in rows})
            metrics.update(adv_metrics)
            if analysis:  # RAGEN-2's: before the actor's update
                with self.timer("gradient_analysis"):
                    metrics.update(self._gradient_analysis(batch, rows, source))
            metrics.update(self._update(batch, rows, source, prior_gap))
        critic = self.critic is not None
        metrics.update(data_metrics(  # verl's batch statistics of the kept trajectories (identical on every rank)
            [t.reward for t in batch], [t.loss_mask for t in batch], [t.advantages for t in batch],
            [t.returns for t in batch] if critic else None, [t.values for t in batch] if critic else None,
            [len(t.input_ids) for t in batch], cfg.rollout.max_model_len))
        self._sync_engine()
        metrics["perf/rollout_tokens"] = float(sum(len(t.input_ids) for t in episodes))
        metrics["perf/trained_seq_tokens"] = float(sum(len(t.input_ids) for t in batch))
        return metrics

    def train(self) -> None:
        """Run until trainer.iterations; validation, checkpoints and metrics as configured."""
        t = self.cfg.trainer
        if t.val_before_train and self.step == 0:
            metrics = self.validate()
            metrics.update(self.timer.pop())  # step 0's phases (the first weight sync, validation), not step 1's
            self.logger.log(0, metrics)
        else:
            self.timer.pop()  # the start-up weight sync is no part of the first iteration
        while self.step < t.iterations:
            self.step += 1
            start = time.perf_counter()
            metrics = self.iteration()
            if t.val_every and (self.step % t.val_every == 0 or self.step == t.iterations):  # RAGEN: + last step
                metrics.update(self.validate())
            metrics.update(self.timer.pop())
            metrics["timing/iteration"] = time.perf_counter() - start
            metrics["perf/tokens_per_s"] = metrics.get("perf/rollout_tokens", 0.0) / metrics["timing/iteration"]
            metrics.update(memory_metrics(self.device))
            for warning in self.trap.update(metrics):
                self.logger.warn(warning)
            metrics.update(self.trap.metrics())
            self.logger.log(self.step, metrics)
            # after the metrics line (and the echo-trap update): a checkpoint never runs ahead of metrics.jsonl, so a
            # kill in between loses no row; the save's time lands in the next row's timing/save
            if t.save_every and self.step % t.save_every == 0:
                with self.timer("save"):
                    self.save()

    def close(self, export: bool = True) -> None:
        """Final checkpoint (unless this step is saved already) and Hugging Face export to <run_dir>/hf, then the
        logger and the engine are closed. Runs once: later calls return at once (every rank calls it)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if export:
            latest = checkpoint.latest(self.run_dir) if du.is_main() else None
            # decided once on rank 0: node-local disks may differ, and a rank that skips the collective save hangs
            if du.broadcast_object(latest is None or checkpoint.read_meta(latest)["step"] != self.step):
                self.save()
            checkpoint.export_hf(self.actor, self.tokenizer, self.run_dir / "hf")
            if du.is_main():
                (self.run_dir / "hf" / "fastpo_config.json").write_text(
                    json.dumps({"config_hash": self.config_hash, "step": self.step}) + "\n")
        if self.pool is not None:
            self.pool.close()
        self.logger.close()
        self.engine.close()
        self.unlock()
