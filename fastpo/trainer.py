"""The StarPO / StarPO-S training loop (docs/SEMANTICS.md sections 4-8). One iteration:

    rollout (this rank's env groups) -> all-gather the trajectories -> StarPO-S filter (same decision on every
    rank) -> old logprobs (+ values) with the trainer -> advantages -> critic update -> actor update ->
    weight sync into the engine -> validation every val_every -> checkpoint every save_every -> metrics line

    trainer = Trainer(cfg, dist_info)       # loads models, envs, engine; resumes per cfg.trainer.resume
    trainer.train()                         # raises TrainingAborted on a logprob-gap / non-finite-loss stop
    trainer.close()                         # final checkpoint + Hugging Face export (<run_dir>/hf)

Data parallelism. Rank r owns the consecutive env groups ``shard_groups(env_groups, world, r)``; global group g
uses env ``names[g % len(names)]`` and, at the iteration whose seed counter is c, env seed ``c + g`` (a group
shares a seed; c starts at env.train_seed and advances by env_groups per iteration). Per-request sampling seeds
depend on (trainer.seed, step, global trajectory index) only, so 1 and N ranks sample the same trajectories.
After the rollout every rank all-gathers the (small) token lists of all trajectories, so the filter, the
advantages (GAE whitening is over the whole batch) and the mini-batch split are computed identically everywhere;
rank r trains trajectories ``mini_batch[r::world]``. Ranks run the same number of micro-batches (a rank short of
data repeats one with loss scale 0), as FSDP2's collectives require.

Micro-batches hold consecutive trajectories of at most ``optim.micro_batch_tokens`` tokens in all, and every
per-token tensor is PACKED ([N], trajectories concatenated). The forward sees them in one of three layouts
(``optim.micro_batch_layout``, see ``fastpo.microbatch``): packed (one row, ``position_ids`` restarting at 0 for
each trajectory, no attention mask; transformers builds a block-diagonal causal mask from the position ids, which
flash_attention_2 turns into its varlen kernel but sdpa / eager run as a dense mask over the whole row), padded
(one right-padded row per trajectory and plain causal attention: no trajectory attends to a pad; the pads' outputs
are dropped when the hidden states are gathered back into the packed order) or shared (one row per group: the
prompt prefix its trajectories share once, then each one's own tokens under a 4D mask; the prefix's hidden states
are gathered once per trajectory, so its gradient sums theirs; per micro-batch only where a FLOP estimate says it
beats padded rows). ``auto`` = packed with flash_attention_2, shared otherwise: on CPU packed attention over a
8k-token row cost more than the rest of the update, and in single-turn GRPO ~90% of a sequence is the prompt its
group repeats. All three are tested equal to separate forwards (logprobs, values and gradients).
Logprobs come from ``fastpo.kernels.fused_linear_logprob`` on the last hidden states of the trained positions and
the lm-head weight (never full logits). The hidden states are read through the ROOT module's forward with
``logits_to_keep=1`` and a hook on the decoder (see ``fastpo.engine.fsdp``), not with
``model.policy_hidden_states``, which calls the decoder alone and would bypass FSDP2's root unit.

Loss scaling: each micro-batch's loss (aggregated over the micro-batch by loss_agg_mode) is multiplied by its
share of the mini-batch (trained tokens for token-mean, trajectories for seq-mean-token-sum / -mean; 1 for
seq-mean-token-sum-norm, a plain token sum over one constant, the longest kept trajectory) times the world size
(FSDP2 averages gradients over ranks), so the accumulated gradient equals one loss over the whole mini-batch.

Stops: (1) the mean |engine logp - trainer logp| over sampled trained tokens right after a weight sync exceeds
trainer.logprob_gap_max; (2) optim.max_nonfinite_in_a_row consecutive actor steps with a non-finite loss or grad
norm (each is skipped and counted in ``actor/nonfinite_skips``). Both raise :class:`TrainingAborted` on every rank;
the last checkpoint is left as it was. Test hook: ``FASTPO_INJECT_NAN_AT=2,3`` multiplies the actor loss by NaN
at those iterations (1-based step numbers).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import algorithms, checkpoint, env_mix, envs, kernels, storage
from . import distributed as du
from .config import Config, config_hash, to_dict, to_json
from .config import validate as validate_config
from .engine.base import Engine, SamplingParams
from .engine.fsdp import full_state_dict, init_single_rank_group, load_sharded, make_adamw, needs_master_weights
from .engine.hf import HFEngine
from .metrics import (
    EchoTrapMonitor,
    EchoTrapThresholds,
    MetricsLogger,
    PhaseTimer,
    data_metrics,
    memory_metrics,
    pick_generations,
)
from .microbatch import MicroBatch, Sample, cat_tokens, lm_head_inputs, pack, split_tokens, token_cost, turn_data
from .model import is_lora, load_critic, load_policy, load_tokenizer, merged_state_dict, resolve_attn_implementation
from .preflight import check_prompt_fits
from .prompts import env_prompt_spec
from .rollout import RolloutConfig, RolloutPart, run_rollouts

#: ``model.path`` placeholder of the tiny CPU agent (the ``tiny`` preset).
TINY_MODEL = "tiny"
#: Env var of the NaN-injection test hook: comma-separated 1-based iteration numbers.
INJECT_NAN_ENV = "FASTPO_INJECT_NAN_AT"


class TrainingAborted(RuntimeError):
    """A deliberate stop (weight-sync logprob gap, too many non-finite steps); the message says why."""


# ----------------------------------------------------------------------------------------------- helpers
def resolve_model_path(path: str, run_dir: str | os.PathLike) -> str:
    """``"tiny"`` -> the tiny CPU agent's folder (``fastpo.tiny_agent.tiny_agent_path``: the one shipped in the
    package, else built once into the user cache by rank 0 while the other ranks wait); any other path is
    returned as is. `run_dir` is unused (kept for callers)."""
    if path != TINY_MODEL:
        return path
    from .tiny_agent import tiny_agent_path

    resolved = str(tiny_agent_path()) if du.is_main() else ""
    du.barrier()
    return str(tiny_agent_path(build_if_missing=False)) if not du.is_main() else resolved


def request_seed(seed: int, kind: int, step: int, index: int) -> int:
    """Sampling seed of trajectory `index` (global) at `step`: a function of these numbers only (not of the
    world size). kind 0 = training, 1 = validation."""
    return int(np.random.SeedSequence([seed, kind, step, index]).generate_state(1, np.uint32)[0])


def injected_nan_steps() -> set[int]:
    """Iterations (1-based) whose actor loss the ``FASTPO_INJECT_NAN_AT`` test hook makes NaN."""
    raw = os.environ.get(INJECT_NAN_ENV, "").strip()
    try:
        return {int(s) for s in raw.split(",") if s.strip()}
    except ValueError:
        raise ValueError(f"{INJECT_NAN_ENV} must be comma-separated iteration numbers, got {raw!r}") from None


def all_gather_list(items: list) -> list:
    """Concatenation over ranks (in rank order) of every rank's picklable list; the list itself alone."""
    if not du.is_distributed():
        return list(items)
    out: list[Any] = [None] * du.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Per-key mean over the ranks that report the key (keys may differ between ranks)."""
    parts = all_gather_list([metrics])
    keys = sorted({k for p in parts for k in p})
    return {k: float(np.mean([p[k] for p in parts if k in p])) for k in keys}


def all_reduce_max(value: float) -> float:
    """Maximum of a scalar over ranks (on the current CUDA device when there is one: NCCL needs it)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    if du.is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimiser holds: all of them, or under LoRA the adapters (and the critic's value head)."""
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------- trainer
class Trainer:
    """StarPO / StarPO-S trainer. Its checkpointed state: models, optimisers, schedulers and :meth:`state_dict`
    (step, env seed counter, non-finite counters, echo-trap history) plus per-rank RNG states."""

    def __init__(self, cfg: Config, info: du.DistInfo | None = None):
        self.cfg = cfg
        self.info = info or du.init()
        validate_config(cfg, self.info.world_size)  # library users may build a Trainer without train.py
        self.rank, self.world = self.info.rank, self.info.world_size
        self.device = self.info.device
        self.run_dir = Path(cfg.trainer.run_dir)
        # refuses mismatched ranks and resume=never over a previous run (unless overwrite), before anything is written
        storage.claim_run_dir(self.run_dir, cfg.trainer.resume, cfg.trainer.overwrite, config_hash(cfg))
        if du.is_main():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(to_json(cfg) + "\n")
        du.barrier()
        du.seed_everything(cfg.trainer.seed, self.rank)
        if cfg.trainer.deterministic:
            du.set_deterministic(True)
        self.config_hash = config_hash(cfg)
        self.model_path = resolve_model_path(cfg.model.path, self.run_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        check_prompt_fits(cfg, self.tokenizer)  # ConfigError before any model loads when no turn could fit
        self._build_models()
        self._build_envs()
        self.step = 0
        self.train_seed = cfg.env.train_seed
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.critic_nonfinite_total = 0
        self.nan_steps = injected_nan_steps()
        t = cfg.trainer
        # the monitor's entropy check is symmetric: use the drop factor (the early signal, docs/SEMANTICS.md section 7)
        self.trap = EchoTrapMonitor(EchoTrapThresholds(std_floor=t.min_in_group_std,
                                                       entropy_rel_change=1.0 - t.entropy_drop_factor,
                                                       grad_spike_k=t.grad_norm_spike_factor))
        # a run resumed from a checkpoint continues its W&B run (id in the run dir); a fresh start opens a new one
        wandb_resume = t.resume != "never" and (t.resume != "auto" or checkpoint.latest(self.run_dir) is not None)
        self.logger = MetricsLogger(self.run_dir, self.rank, console=t.log_console, jsonl=t.log_jsonl,
                                    tensorboard=t.log_tensorboard, wandb=t.log_wandb, project=t.wandb_project,
                                    run_name=t.run_name or None, config=to_dict(cfg), total_steps=t.iterations,
                                    wandb_resume=wandb_resume, metric_names=t.metric_names)
        self.timer = PhaseTimer(synchronize=self.device.type == "cuda")
        self.resumed_from = self._resume()
        self.logger.start_progress(self.step)  # a resumed run's bar continues at its step, its ETA covers the rest
        self._sync_engine()

    # ---- setup ----------------------------------------------------------------------------------------------
    def _build_models(self) -> None:
        cfg = self.cfg
        # a compute dtype below fp32 runs as FSDP2 mixed precision over fp32 master weights (fp32 AdamW states), with
        # or without torchrun: a single process gets a world-1 process group for it (fastpo.engine.fsdp)
        master = needs_master_weights(cfg.model.dtype)
        if master:
            init_single_rank_group(self.device)
        dtype = torch.float32 if master else cfg.model.dtype
        mp = getattr(torch, cfg.model.dtype) if master else None
        # LoRA (model.lora_rank > 0): peft freezes the base weights; only the adapters (and the value head) train
        lora = {"lora_rank": cfg.model.lora_rank, "lora_alpha": cfg.model.lora_alpha,
                "lora_target_modules": cfg.model.lora_target_modules, "lora_seed": cfg.trainer.seed}
        attn = resolve_attn_implementation(cfg.model.attn_implementation, self.device, cfg.model.dtype)
        # Liger patches transformers' modules in place: every model built afterwards (engine, reference) uses them
        common = {"attn_implementation": attn, "liger_kernel": cfg.model.liger_kernel}
        # meta init (model.meta_init): under torchrun only rank 0 reads the actor / critic weights, the others get
        # them by broadcast into their shards; LoRA models load on every rank (peft on meta tensors unsupported)
        meta_init = cfg.model.meta_init and cfg.model.lora_rank == 0
        shard = {"mixed_precision": mp, "activation_checkpointing": cfg.model.gradient_checkpointing}
        self.actor = load_sharded(lambda meta: load_policy(self.model_path, dtype=dtype, meta=meta, **common, **lora),
                                  self.device, meta_init, **shard)
        o = cfg.optim
        self.actor_optim = make_adamw(trainable_parameters(self.actor), self.device, lr=o.actor_lr, betas=o.betas,
                                      weight_decay=o.weight_decay)
        self.actor_sched = self._scheduler(self.actor_optim)
        self.critic = self.critic_optim = self.critic_sched = None
        if algorithms.needs_critic(cfg.algorithm):
            path = resolve_model_path(cfg.model.critic_path, self.run_dir) if cfg.model.critic_path else self.model_path
            self.critic = load_sharded(lambda meta: load_critic(path, dtype=dtype, head_seed=cfg.trainer.seed,
                                                                meta=meta, **common, **lora),
                                       self.device, meta_init, **shard)
            self.critic_optim = make_adamw(trainable_parameters(self.critic), self.device, lr=o.critic_lr,
                                           betas=o.betas, weight_decay=o.weight_decay)
            self.critic_sched = self._scheduler(self.critic_optim)
        self.ref = None
        # the reference policy is the initial policy: under LoRA that is the actor with its adapter disabled (the
        # frozen base weights), so no second copy is loaded
        self.use_ref = algorithms.needs_reference(cfg.algorithm)
        if self.use_ref and not is_lora(self.actor):
            self.ref = load_policy(self.model_path, dtype=cfg.model.dtype, attn_implementation=attn).to(self.device)
            self.ref.eval()
            self.ref.requires_grad_(False)
        # the HF engine's model keeps transformers' default attention: its KV-cache slabs need masks with holes,
        # which flash_attention_2 does not take
        self.engine = self._build_engine()
        attn = getattr(getattr(self.actor, "config", None), "_attn_implementation", None)
        layout = cfg.optim.micro_batch_layout
        if layout == "auto":
            layout = "packed" if attn == "flash_attention_2" else "shared"
        if layout == "shared" and attn == "flash_attention_2":
            raise ValueError("optim.micro_batch_layout=shared needs a 4D attention mask, which flash_attention_2 does "
                             "not take: use packed or auto with model.attn_implementation=flash_attention_2")
        self._layout, self._token_cost = layout, token_cost(self.actor)

    def _build_engine(self) -> Engine:
        """This rank's generation engine (rollout.engine), holding its own full copy of the policy; weights are
        pushed after every update (``_sync_engine``). vLLM: one in-process instance per rank, generating for the
        rank's own groups; under torchrun it joins the existing process group as an independent replica
        (``external_launcher``, tensor parallel 1; on GPU it uses the rank's device)."""
        cfg, r = self.cfg, self.cfg.rollout
        if r.engine == "vllm":
            from .engine.vllm import VLLMEngine

            return VLLMEngine(
                self.model_path, self.tokenizer, seed=cfg.trainer.seed + self.rank, dtype=cfg.model.dtype,
                kv_cache_bytes=r.kv_cache_mb * 2**20 if r.kv_cache_mb else None,
                gpu_memory_utilization=r.gpu_memory_utilization,
                max_model_len=r.max_model_len,  # the rollout keeps context + response_length within it
                distributed_executor_backend="external_launcher" if self.world > 1 else None,
                tensor_parallel_size=1)
        engine_model = load_policy(self.model_path, dtype=cfg.model.dtype).to(self.device).eval()
        engine_model.requires_grad_(False)
        return HFEngine(engine_model, self.tokenizer, seed=cfg.trainer.seed + self.rank)

    def _scheduler(self, optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        warmup = self.cfg.optim.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)

    def _env_parts(self, entries: list[env_mix.EnvEntry], groups: range, prefix: str) -> list[dict]:
        """One batch env per mix entry for this rank's groups (``fastpo.env_mix``: legacy names round-robin, or
        env.train / env.val entries in contiguous blocks), each with its own config, budgets and label."""
        cfg = self.cfg
        offsets = env_mix.trajectory_offsets(entries)
        parts = []
        for entry in entries:
            mine = [g for g in groups if g in set(entry.groups)]
            if not mine:
                continue
            env = envs.make(entry.name, len(mine) * entry.group_size, backend=cfg.env.backend, **entry.kwargs)
            budget = {} if entry.max_actions_per_traj is None else {"max_actions_per_traj": entry.max_actions_per_traj}
            parts.append({
                "name": entry.name, "groups": mine, "group_size": entry.group_size, "env": env,
                "first_index": [offsets[g] for g in mine],
                "spec": env_prompt_spec(entry.name, env, enable_think=cfg.rollout.enable_think,
                                        action_sep=cfg.env.action_sep, **budget),
                "rollout": RolloutConfig(
                    max_turns=entry.max_turns, max_actions_per_turn=entry.max_actions_per_turn,
                    format_penalty=cfg.rollout.format_penalty, max_model_len=cfg.rollout.max_model_len,
                    max_context_window=cfg.rollout.max_context_window, canonical=cfg.rollout.canonical,
                    train_on_observations=cfg.rollout.train_on_observations,
                    use_turn_scores=cfg.rollout.reward_level == "turn", env_metric_prefix=prefix,
                    env_label=entry.label),
            })
        return parts

    def _build_envs(self) -> None:
        e = self.cfg.env
        envs.load_plugins(e.plugins)  # every rank, before any env is built (validate did it on this rank too)
        self.train_parts = self._env_parts(env_mix.resolve_mix(e, "train"),
                                           du.shard_groups(e.env_groups, self.world, self.rank), "env")
        self.val_parts = self._env_parts(env_mix.resolve_mix(e, "val"),
                                         du.shard_groups(e.val_groups, self.world, self.rank), "val-env")

    # ---- checkpoint state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The trainer's own resumable state (JSON-serialisable)."""
        return {
            "step": self.step, "train_seed": self.train_seed, "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total, "critic_nonfinite_total": self.critic_nonfinite_total,
            "weight_version": self.engine.weight_version,
            "echo_trap": {"history": {k: list(v) for k, v in self.trap.history.items()},
                          "counts": dict(self.trap.counts), "iteration": self.trap.iteration},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from collections import Counter, deque

        self.step, self.train_seed = int(state["step"]), int(state["train_seed"])
        self.nonfinite_in_a_row, self.nonfinite_total = int(state["nonfinite_in_a_row"]), int(state["nonfinite_total"])
        self.critic_nonfinite_total = int(state["critic_nonfinite_total"])
        trap = state["echo_trap"]
        self.trap.history = {k: deque(v, maxlen=self.trap.t.window) for k, v in trap["history"].items()}
        self.trap.counts, self.trap.iteration = Counter(trap["counts"]), int(trap["iteration"])

    def _stateful(self) -> dict[str, Any]:
        objs: dict[str, Any] = {"actor": self.actor, "actor_optim": self.actor_optim, "actor_sched": self.actor_sched}
        if self.critic is not None:
            objs.update(critic=self.critic, critic_optim=self.critic_optim, critic_sched=self.critic_sched)
        return objs

    def _resume(self) -> str | None:
        state = checkpoint.resume(self.run_dir, self._stateful(), mode=self.cfg.trainer.resume,
                                  config_hash=self.config_hash)
        # metrics.jsonl keeps the rows up to the resumed step: the steps after it are replayed and logged again
        dropped = self.logger.truncate_after(-1 if state is None else int(state["step"]))
        if dropped:
            du.print0(f"metrics.jsonl: dropped {dropped} row(s) after step {-1 if state is None else state['step']} "
                      f"(replayed by this run)")
        if state is None:
            return None
        self.load_state_dict(state)
        du.print0(f"resumed from step {self.step} ({self.run_dir})")
        return str(self.step)

    def save(self) -> Path:
        """Checkpoint the current step (collective)."""
        return checkpoint.save(self.run_dir, self.step, self._stateful(), self.state_dict(),
                               keep_last=self.cfg.trainer.keep_last, config_hash=self.config_hash)

    def _sync_engine(self) -> None:
        """Push the actor's weights into the engine (collective under FSDP2: every rank calls it)."""
        with self.timer("sync"):
            if isinstance(self.engine, HFEngine):
                self.engine.sync_weights(full_state_dict(self.actor))  # LoRA: adapters merged, plain names
            else:
                # vLLM gathers the sharded (DTensor) parameters one bucket at a time while it pushes them, so the
                # full model never exists twice on a rank; on GPU this also wakes a sleeping engine. LoRA: the
                # engine gets plain names, each adapted weight merged (W + scaling * B @ A) as its bucket is pushed
                state = self.actor.state_dict()
                self.engine.sync_weights(merged_state_dict(self.actor, state) if is_lora(self.actor) else state)

    # ---- rollout --------------------------------------------------------------------------------------------
    def _rollout(self, parts: list[dict], seed_base: int, kind: int, temperature: float,
                 step: int, records: list | None = None) -> tuple[list, dict]:
        """Run every env part; returns (this rank's Samples, rank-averaged metrics). `step` feeds the request
        seeds (validation passes 0: the same sampling seeds every time). ``records``, when given, receives one
        generation record (GENERATION_FIELDS but step) per trajectory of this rank."""
        r = self.cfg.rollout
        sampling = SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.response_length, stop=tuple(r.stop))
        samples, sums_here, counts_here = [], {}, {}
        jobs = []
        for part in parts:
            gs = part["group_size"]
            seeds = np.repeat([seed_base + g for g in part["groups"]], gs)
            group_ids = np.repeat(part["groups"], gs)
            idx = [first + j for first in part["first_index"] for j in range(gs)]
            req = [request_seed(self.cfg.trainer.seed, kind, step, i) for i in idx]
            jobs.append(RolloutPart(part["env"], part["spec"], seeds, group_ids, part["rollout"], req))
        # all envs' instances generate together: one engine call per turn, not one per env
        for part, batch in zip(parts, run_rollouts(jobs, self.engine, self.tokenizer, sampling), strict=True):
            if records is not None:
                records.extend(self._generation_record(part["rollout"].env_label, t) for t in batch.trajectories)
            for t in batch.trajectories:
                samples.append(Sample(np.asarray(t.input_ids, np.int64), np.asarray(t.loss_mask, bool),
                                      np.asarray(t.sample_logprobs, np.float32),
                                      np.asarray(t.token_rewards, np.float32), np.asarray(t.turn_end, bool),
                                      float(t.reward), int(t.group), bool(t.logprobs_exact)))
                samples[-1].turn_keys, samples[-1].turn_rewards = turn_data(
                    samples[-1].turn_end, t.turn_state_keys, t.turn_rewards, t.turn_penalties)
            n = len(batch.trajectories)
            for key, value in batch.metrics.items():  # parts share the rollout/* keys: combine, don't overwrite
                if key.endswith("_max"):
                    sums_here[key], counts_here[key] = max(sums_here.get(key, -math.inf), value), 1
                else:
                    sums_here[key] = sums_here.get(key, 0.0) + value * n
                    counts_here[key] = counts_here.get(key, 0) + n
        # combine over ranks by trajectory count: with env.train mixes ranks can hold different numbers of them
        sums, counts = {}, {}
        for rank_sums, rank_counts in all_gather_list([(sums_here, counts_here)]):
            for key, value in rank_sums.items():
                if key.endswith("_max"):
                    sums[key], counts[key] = max(sums.get(key, -math.inf), value), 1
                else:
                    sums[key], counts[key] = sums.get(key, 0.0) + value, counts.get(key, 0) + rank_counts[key]
        return samples, {key: sums[key] / max(counts[key], 1) for key in sorted(sums)}

    def _generation_record(self, label: str, traj: Any) -> dict[str, Any]:
        """One validation sample for the generations table: the prompt (tokens before the first trained one) and
        the response (the rest: every turn and observation), decoded with special tokens."""
        ids, mask = traj.input_ids, traj.loss_mask
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        return {"env": label, "group": int(traj.group), "seed": int(traj.seed),
                "prompt": self.tokenizer.decode(ids[:first]), "response": self.tokenizer.decode(ids[first:]),
                "reward": float(traj.reward), "success": bool(traj.success)}

    def validate(self) -> dict[str, float]:
        """Fixed-seed validation (env.val_seed, rollout.val_temperature): ``val-env/<Env>/...`` metrics; logs
        trainer.log_generations sampled generations at the current step (collective)."""
        n = self.cfg.trainer.log_generations
        records: list | None = [] if n > 0 else None
        with self.timer("validate"):
            _, metrics = self._rollout(self.val_parts, self.cfg.env.val_seed, 1, self.cfg.rollout.val_temperature, 0,
                                       records=records)
            if records is not None:
                self.logger.log_generations(self.step, pick_generations(all_gather_list(records), n))
        return {k: v for k, v in metrics.items() if k.startswith("val-env/")}

    # ---- forward passes -------------------------------------------------------------------------------------
    def _actor_logp(self, model: nn.Module, mb: MicroBatch, mask: Tensor, entropy: bool):
        """logp (and entropy) fp32 [N] of every token under `model` at the sampling temperature (0 where
        mask is 0: only trained positions are computed)."""
        hidden, weight, bias = lm_head_inputs(model, mb)
        tgt = mask.nonzero().squeeze(-1)
        out = kernels.fused_linear_logprob(hidden[0, tgt - 1], weight, mb.input_ids[0, tgt], bias,
                                           temperature=self.cfg.rollout.temperature, return_entropy=entropy)
        n = mask.shape[0]
        vals = out if isinstance(out, tuple) else (out,)
        full = tuple(torch.zeros(n, dtype=torch.float32, device=mask.device).index_copy(0, tgt, v) for v in vals)
        return full if entropy else full[0]

    def _ref_logp(self, mb: MicroBatch, mask: Tensor) -> Tensor:
        """Reference-policy logp fp32 [N] (as _actor_logp): the reference model, or under LoRA the actor with its
        adapter disabled (peft ``disable_adapter``: the frozen base weights)."""
        if self.ref is not None:
            return self._actor_logp(self.ref, mb, mask, False)
        with self.actor.disable_adapter():
            return self._actor_logp(self.actor, mb, mask, False)

    def _values(self, mb: MicroBatch, mask: Tensor) -> Tensor:
        """Critic values fp32 [N]: V_t from the hidden state before token t (verl's alignment), 0 off the mask."""
        v = mb.to_packed(self.critic(**mb.model_inputs(self.critic)))[0]
        tgt = mask.nonzero().squeeze(-1)
        return torch.zeros_like(v, dtype=torch.float32).index_copy(0, tgt, v[tgt - 1].float())

    def _pack(self, samples: list[Sample], indices: list[int], max_tokens: int | None = None) -> list[MicroBatch]:
        """Micro-batches of the given trajectories in the trainer's layout (optim.micro_batch_layout, resolved)."""
        return pack(samples, indices, max_tokens or self.cfg.optim.micro_batch_tokens, self.device, self._layout,
                    self._token_cost)

    @torch.no_grad()
    def _score(self, samples: list[Sample], kept: list[int], actor: bool = True) -> None:
        """Old logprobs (and ref logprobs / values) of the kept trajectories: each rank computes kept[r::world],
        then all ranks exchange them, so every Sample in `kept` gets old_logp (ref_logp, values) arrays.
        ``actor=False`` skips the old logprobs (on-policy: the update's own forward provides them)."""
        if not actor and not self.use_ref and self.critic is None:
            return
        mine = kept[self.rank::self.world]
        results = []
        micro = self._pack(samples, mine)
        n_micro = int(all_reduce_max(len(micro)))
        for k in range(n_micro):
            mb = micro[k] if k < len(micro) else self._pack(samples, kept[:1], 10**9)[0]
            mask = cat_tokens(samples, mb.indices, "loss_mask", self.device)
            out = {}
            if actor:
                out["old_logp"] = split_tokens(self._actor_logp(self.actor, mb, mask, False), mb.cu_seqlens)
            if self.use_ref:
                out["ref_logp"] = split_tokens(self._ref_logp(mb, mask), mb.cu_seqlens)
            if self.critic is not None:
                # verl's GAE reads the values of observation tokens too: compute them over the response span
                vmask = mask if self.cfg.algorithm.gae_skip_observations else kernels.reference.response_span(
                    mask, mb.cu_seqlens)
                out["values"] = split_tokens(self._values(mb, vmask), mb.cu_seqlens)
            if k < len(micro):
                results += [(i, {f: out[f][j] for f in out}) for j, i in enumerate(mb.indices)]
        for i, fields in all_gather_list(results):
            for f, v in fields.items():
                setattr(samples[i], f, v)

    def _logprob_gap(self, samples: list[Sample], kept: list[int]) -> dict[str, float]:
        """|engine logp - trainer logp| over trained tokens of trajectories with exact sample logprobs."""
        gaps = [np.abs(samples[i].sample_logprobs - samples[i].old_logp)[samples[i].loss_mask]
                for i in kept if samples[i].exact and not self.cfg.rollout.train_on_observations]
        gaps = np.concatenate(gaps) if gaps else np.zeros(0)
        if not gaps.size:
            return {}
        return {"rollout/logprob_gap_mean": float(gaps.mean()), "rollout/logprob_gap_max": float(gaps.max())}

    def _check_gap(self, gap: dict[str, float]) -> None:
        """The parity guard: abort when the engine did not sample from the weights the trainer holds."""
        if gap and gap["rollout/logprob_gap_mean"] > self.cfg.trainer.logprob_gap_max:
            raise TrainingAborted(
                f"step {self.step}: mean |engine logp - trainer logp| = {gap['rollout/logprob_gap_mean']:.4g} right "
                f"after weight sync {self.engine.weight_version} exceeds trainer.logprob_gap_max="
                f"{self.cfg.trainer.logprob_gap_max}: the engine is not sampling from the trained weights")

    def _micro_gap(self, samples: list[Sample], mb: MicroBatch, mask: Tensor, logp: Tensor) -> tuple[float, int, float]:
        """(sum, count, max) of |engine logp - trainer logp| over one micro-batch's trained tokens of trajectories
        with exact sample logprobs (the on-policy form of _logprob_gap)."""
        if self.cfg.rollout.train_on_observations:
            return 0.0, 0, 0.0
        exact = torch.cat([torch.full((len(samples[i].input_ids),), samples[i].exact, dtype=torch.bool)
                           for i in mb.indices]).to(self.device)
        sel = mask.bool() & exact
        diff = (cat_tokens(samples, mb.indices, "sample_logprobs", self.device) - logp)[sel].abs()
        return float(diff.sum()), int(diff.numel()), float(diff.max()) if diff.numel() else 0.0

    def _reduce_gap(self, total: float, count: int, peak: float) -> dict[str, float]:
        """Combine the ranks' micro-batch gaps into _logprob_gap's metrics ({} when no token qualified)."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        t = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        if du.is_distributed():
            dist.all_reduce(t)
        peak = all_reduce_max(peak)
        if t[1] == 0:
            return {}
        return {"rollout/logprob_gap_mean": float(t[0] / t[1]), "rollout/logprob_gap_max": float(peak)}

    def _on_policy(self, kept: list[int]) -> bool:
        """One epoch over one mini-batch: the update's forward runs on the weights that sampled, so its detached
        logp is the old logp (ratio exactly 1) and the separate no-grad scoring pass of the actor is skipped."""
        return self.cfg.optim.ppo_epochs == 1 and len(self._mini_batches(kept)) == 1

    # ---- update ---------------------------------------------------------------------------------------------
    def _mini_batches(self, kept: list[int], epoch: int = 0) -> list[list[int]]:
        """The mini-batches of one epoch. Kept trajectories come group by group, so in order a mini-batch would
        hold whole groups (e.g. 2 of the 8 initial states): each step would chase a few states. With
        optim.shuffle_mini_batches they are drawn from a permutation seeded by (seed, step, epoch): identical on
        every rank, independent of the world size, and reproduced on resume."""
        size = self.cfg.optim.mini_batch_size
        order = list(kept)
        if self.cfg.optim.shuffle_mini_batches and len(order) > size:
            rng = np.random.default_rng([self.cfg.trainer.seed, 2, self.step, epoch])
            order = [order[j] for j in rng.permutation(len(order))]
        return [order[i:i + size] for i in range(0, len(order), size)]

    @staticmethod
    def _norm_len(samples: list[Sample], kept: list[int]) -> float:
        """seq-mean-token-sum-norm's divisor: the longest kept trajectory (all ranks see all of them), one constant
        for every micro-batch of the iteration, as verl's padded batch width (not each packed micro-batch's own
        longest sequence, which would weigh short micro-batches up)."""
        return float(max(len(samples[i].input_ids) for i in kept))

    def _micro_plan(self, samples: list[Sample], mb_indices: list[int]) -> list[MicroBatch]:
        """This rank's packed micro-batches of one mini-batch, each with its loss scale; padded with scale-0
        repeats to the same count on every rank."""
        a = self.cfg.algorithm
        mine = mb_indices[self.rank::self.world]
        micro = self._pack(samples, mine)
        token_mean = a.loss_agg_mode == "token-mean"
        total = sum(int(samples[i].loss_mask.sum()) for i in mb_indices) if token_mean else len(mb_indices)
        for mb in micro:
            part = sum(int(samples[i].loss_mask.sum()) for i in mb.indices) if token_mean else len(mb.indices)
            mb.scale = part / max(total, 1) * self.world
            if a.loss_agg_mode == "seq-mean-token-sum-norm":  # a plain sum / a batch constant: no share to take
                mb.scale = float(self.world)
        n_micro = int(all_reduce_max(len(micro)))
        while len(micro) < n_micro:
            filler = self._pack(samples, (mine or mb_indices)[:1], 10**9)[0]
            filler.scale = 0.0
            micro.append(filler)
        return micro

    def _step(self, model: nn.Module, optim: torch.optim.Optimizer, sched: Any, loss_sum: float) -> tuple[float, bool]:
        """Clip, check and step; returns (grad norm, stepped). A non-finite loss or grad norm skips the step."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.optim.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        ok = math.isfinite(norm) and math.isfinite(loss_sum)
        ok = all_reduce_max(0.0 if ok else 1.0) == 0.0
        if ok:
            optim.step()
            sched.step()
        optim.zero_grad(set_to_none=True)
        return norm, ok

    def _reduce_sums(self, sums: dict[str, float], kept: list[int]) -> dict[str, float]:
        """Share-weighted per-rank metric sums -> mini-batch means, averaged over mini-batches and epochs."""
        n = self.cfg.optim.ppo_epochs * len(self._mini_batches(kept))
        return {k: v * self.world / n for k, v in mean_over_ranks(sums).items()}

    def _update_critic(self, samples: list[Sample], kept: list[int]) -> dict[str, float]:
        a, sums = self.cfg.algorithm, {}
        norm_len = self._norm_len(samples, kept)
        norms = []
        for epoch in range(self.cfg.optim.ppo_epochs):
            for mbi in self._mini_batches(kept, epoch):
                loss_sum = 0.0
                for mb in self._micro_plan(samples, mbi):
                    mask = cat_tokens(samples, mb.indices, "loss_mask", self.device)
                    values = self._values(mb, mask)
                    old = cat_tokens(samples, mb.indices, "values", self.device)
                    ret = cat_tokens(samples, mb.indices, "returns", self.device)
                    loss, m = algorithms.critic_loss(values, old, ret, mask, a, cu_seqlens=mb.cu_seqlens,
                                                     norm_len=norm_len)
                    (loss * mb.scale).backward()
                    loss_sum += float(loss.detach()) * mb.scale
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * mb.scale / self.world
                norm, ok = self._step(self.critic, self.critic_optim, self.critic_sched, loss_sum)
                norms.append(norm)
                self.critic_nonfinite_total += not ok
        out = self._reduce_sums(sums, kept)
        out.update({"critic/grad_norm": float(np.mean(norms)), "critic/nonfinite_skips": self.critic_nonfinite_total})
        return out

    def _update_actor(self, samples: list[Sample], kept: list[int]) -> dict[str, float]:
        a, sums = self.cfg.algorithm, {}
        norm_len = self._norm_len(samples, kept)
        norms, inject = [], self.step in self.nan_steps
        on_policy = samples[kept[0]].old_logp is None  # _score skipped the actor: see _on_policy
        gap_sum, gap_n, gap_max = 0.0, 0, 0.0
        for epoch in range(self.cfg.optim.ppo_epochs):
            for mbi in self._mini_batches(kept, epoch):
                loss_sum = 0.0
                for mb in self._micro_plan(samples, mbi):
                    mask = cat_tokens(samples, mb.indices, "loss_mask", self.device)
                    logp, ent = self._actor_logp(self.actor, mb, mask, True)
                    if on_policy:
                        old = logp.detach()
                        if mb.scale > 0:  # scale-0 micro-batches are padding (another rank's trajectory)
                            g = self._micro_gap(samples, mb, mask, old)
                            gap_sum, gap_n, gap_max = gap_sum + g[0], gap_n + g[1], max(gap_max, g[2])
                    else:
                        old = cat_tokens(samples, mb.indices, "old_logp", self.device)
                    adv = cat_tokens(samples, mb.indices, "advantages", self.device)
                    ref = cat_tokens(samples, mb.indices, "ref_logp", self.device) if self.use_ref else None
                    loss, m = algorithms.policy_loss(logp, old, adv, mask, ent, ref, a, cu_seqlens=mb.cu_seqlens,
                                                     norm_len=norm_len)
                    if inject:
                        loss = loss * float("nan")
                    (loss * mb.scale).backward()
                    loss_sum += float(loss.detach()) * mb.scale
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * mb.scale / self.world
                if on_policy:  # the parity guard, before the weights move
                    gap = self._reduce_gap(gap_sum, gap_n, gap_max)
                    sums.update({k: v / self.world for k, v in gap.items()})  # identical on every rank
                    self._check_gap(gap)
                norm, ok = self._step(self.actor, self.actor_optim, self.actor_sched, loss_sum)
                norms.append(norm)
                if ok:
                    self.nonfinite_in_a_row = 0
                else:
                    self.nonfinite_in_a_row += 1
                    self.nonfinite_total += 1
                    du.print0(f"step {self.step}: non-finite actor loss / grad norm ({loss_sum}, {norm}); "
                              f"optimiser step skipped ({self.nonfinite_in_a_row} in a row)")
                    if self.nonfinite_in_a_row >= self.cfg.optim.max_nonfinite_in_a_row:
                        last = checkpoint.latest(self.run_dir)
                        raise TrainingAborted(
                            f"{self.nonfinite_in_a_row} consecutive optimiser steps with a non-finite loss or grad "
                            f"norm (optim.max_nonfinite_in_a_row={self.cfg.optim.max_nonfinite_in_a_row}) at step "
                            f"{self.step}; stopping. Last checkpoint: {last if last else 'none'} (left intact)")
        out = self._reduce_sums(sums, kept)
        out.update({"actor/grad_norm": float(np.mean(norms)), "actor/nonfinite_skips": self.nonfinite_total,
                    "actor/lr": self.actor_sched.get_last_lr()[0]})
        return out

    def _advantages(self, samples: list[Sample], kept: list[int]) -> dict[str, float]:
        """algorithms.compute_advantages over the whole kept batch (identical on every rank); returns the
        estimator's own metrics (gigpo's adv/gigpo_*, else none)."""
        cpu = torch.device("cpu")
        lens = [len(samples[i].input_ids) for i in kept]
        cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64)
        batch = algorithms.PackedBatch(
            token_rewards=cat_tokens(samples, kept, "token_rewards", cpu),
            loss_mask=cat_tokens(samples, kept, "loss_mask", cpu), turn_end=cat_tokens(samples, kept, "turn_end", cpu),
            cu_seqlens=cu, scores=torch.tensor([samples[i].score for i in kept], dtype=torch.float32),
            group_ids=torch.tensor([samples[i].group for i in kept], dtype=torch.int64),
            values=cat_tokens(samples, kept, "values", cpu) if self.critic is not None else None)
        if all(samples[i].turn_keys is not None for i in kept):  # per-turn data: the gigpo estimator reads it
            turns = [len(samples[i].turn_keys) for i in kept]
            batch.cu_turns = torch.tensor([0, *np.cumsum(turns)], dtype=torch.int64)
            batch.turn_keys = cat_tokens(samples, kept, "turn_keys", cpu)
            batch.turn_rewards = cat_tokens(samples, kept, "turn_rewards", cpu)
            batch.turn_ids = algorithms.token_turn_ids(batch.turn_end, cu, batch.cu_turns)
        adv, ret = algorithms.compute_advantages(batch, self.cfg.algorithm)
        for i, a in zip(kept, split_tokens(adv, cu), strict=True):
            samples[i].advantages = a
        if ret is not None:
            for i, r in zip(kept, split_tokens(ret, cu), strict=True):
                samples[i].returns = r
        return batch.metrics

    # ---- the loop -------------------------------------------------------------------------------------------
    def iteration(self) -> dict[str, float]:
        """One training iteration (self.step is the 1-based number of the iteration being run)."""
        cfg = self.cfg
        with self.timer("generate"):
            local, metrics = self._rollout(self.train_parts, self.train_seed, 0, cfg.rollout.temperature, self.step)
            samples = all_gather_list(local)
        self.train_seed += cfg.env.env_groups
        if not any(s.loss_mask.any() for s in samples):  # every rank holds all samples: all stop together
            raise TrainingAborted(
                f"iteration {self.step}: no trajectory has a trained token (mean turns per episode "
                f"{metrics.get('rollout/num_turns', 0.0):g}): the prompts leave no room for rollout.response_length "
                f"({cfg.rollout.response_length}) within rollout.max_model_len ({cfg.rollout.max_model_len})")
        scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples], dtype=torch.int64)
        keep, fmetrics = algorithms.filter_groups(scores, groups, cfg.algorithm.rollout_filter_ratio,
                                                  cfg.algorithm.rollout_filter_type)
        metrics.update(fmetrics)
        kept = keep.nonzero().squeeze(-1).tolist()
        metrics["rollout/kept_trajectories"] = float(len(kept))
        if not kept:
            du.print0(f"step {self.step}: the rollout filter kept no group; update skipped")
            return metrics
        self.engine.sleep()  # GPU vLLM: free its memory for the update; _sync_engine wakes it (else a no-op)
        on_policy = self._on_policy(kept)
        with self.timer("score"):
            self._score(samples, kept, actor=not on_policy)
        if not on_policy:  # on-policy, _update_actor measures the gap on its own forward and runs the guard
            gap = self._logprob_gap(samples, kept)
            metrics.update(gap)
            self._check_gap(gap)
        with self.timer("update"):
            metrics.update(self._advantages(samples, kept))
            if self.critic is not None:
                metrics.update(self._update_critic(samples, kept))
            metrics.update(self._update_actor(samples, kept))
        metrics.update(data_metrics(  # verl's batch statistics of the kept trajectories (identical on every rank)
            [samples[i].score for i in kept], [samples[i].loss_mask for i in kept],
            [samples[i].advantages for i in kept],
            [samples[i].returns for i in kept] if self.critic is not None else None,
            [samples[i].values for i in kept] if self.critic is not None else None,
            [len(samples[i].input_ids) for i in kept], cfg.rollout.max_model_len))
        self._sync_engine()
        metrics["perf/rollout_tokens"] = float(sum(len(s.input_ids) for s in samples))
        metrics["perf/trained_seq_tokens"] = float(sum(len(samples[i].input_ids) for i in kept))
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
        """Final checkpoint (unless this step is saved already) and Hugging Face export to <run_dir>/hf."""
        if export:
            latest = checkpoint.latest(self.run_dir) if du.is_main() else None
            # decided once on rank 0: node-local disks may differ, and a rank that skips the collective save hangs
            if du.broadcast_object(latest is None or checkpoint.read_meta(latest)["step"] != self.step):
                self.save()
            checkpoint.export_hf(self.actor, self.tokenizer, self.run_dir / "hf")
            if du.is_main():
                (self.run_dir / "hf" / "fastpo_config.json").write_text(
                    json.dumps({"config_hash": self.config_hash, "step": self.step}) + "\n")
        self.logger.close()
        self.engine.close()
