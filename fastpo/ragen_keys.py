"""RAGEN's config keys and the fastpo fields they become: the table of the port (``fastpo.ragen_config``) and of
the command line's hints for a setting spelled RAGEN's way (``fastpo.cli``: "RAGEN's clip_ratio_low is
--algorithm.eps_low"). Data and small conversions only: it imports nothing of fastpo.

    short, fields = ragen_equivalents("actor_rollout_ref.actor.clip_ratio_low")   # ("clip_ratio_low", [...eps_low])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _estimator(v: Any) -> str:
    table = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp"}
    if v not in table:
        raise ValueError(f"no fastpo estimator for {v!r}; fastpo has {sorted(table)}")
    return table[v]


def _kl_type(v: Any) -> str:
    table = {"kl": "k1", "k1": "k1", "low_var_kl": "k3", "k3": "k3"}
    if v not in table:
        raise ValueError(f"no fastpo KL estimator for {v!r}; fastpo has kl (k1) and low_var_kl (k3)")
    return table[v]


def _save_every(v: Any) -> int:
    return 0 if int(v) < 0 else int(v)


def _keep_checkpoints(v: Any) -> int:
    """RAGEN's max_*_ckpt_to_keep (verl: null or 0 keeps all) -> trainer.keep_checkpoints (0 keeps all)."""
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("accepted: null or an integer >= 0 (null and 0 keep every checkpoint)")
    return v


def _collapse_samples(v: Any) -> int:
    """collapse_detection.num_samples (an int >= 1 or "all") -> trainer.collapse_num_samples (0 = all)."""
    if v == "all":
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("accepted: an integer >= 1 or 'all'")
    return v


def _positive(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("accepted: an integer >= 1")
    return v


def _non_negative(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("accepted: an integer >= 0")
    return v


def _bucket_mode(v: Any) -> str:
    if v not in ("quantile", "fixed_rv"):
        raise ValueError("accepted: quantile, fixed_rv")
    return v


def _must_equal(expected: Any, why: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if v != expected:
            raise ValueError(f"only {expected!r} is supported: {why}")
    return check


def _adjust_mode(v: Any) -> str:
    if v not in ("copy", "delete"):
        raise ValueError("accepted: copy, delete")
    return v


def _context_mode(v: Any) -> str:
    """agent_proxy.context_window_mode -> rollout.context_window_mode (the same three names)."""
    if v not in ("full", "limited_multi_turn", "single_turn"):
        raise ValueError("accepted: full, limited_multi_turn, single_turn")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("accepted: true or false")
    return v


#: RAGEN key -> (fastpo field, conversion). A conversion returning None with field None is a pure check.
#: (Rows alike in shape are the table's own, one per key: not repeats.)
KEY_MAP: dict[str, tuple[str | None, Callable[[Any], Any]]] = {
    "model_path": ("model.path", str),
    "actor_rollout_ref.model.path": ("model.path", str),
    "critic.model.path": ("model.critic_path", str),
    "lora.rank": ("model.lora_rank", int),
    "lora.alpha": ("model.lora_alpha", int),
    "lora.target_modules": ("model.lora_target_modules", str),
    "actor_rollout_ref.model.lora_rank": ("model.lora_rank", int),
    "actor_rollout_ref.model.lora_alpha": ("model.lora_alpha", int),
    "actor_rollout_ref.model.target_modules": ("model.lora_target_modules", str),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", bool),
    "seed.train": ("env.train_seed", int),
    "seed.val": ("env.val_seed", int),
    "ppo_mini_batch_size": ("optim.mini_batch_size", int),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("optim.mini_batch_size", int),
    "actor_rollout_ref.actor.ppo_epochs": ("optim.ppo_epochs", int),
    "actor_rollout_ref.actor.grad_clip": ("optim.grad_clip", float),
    "actor_rollout_ref.actor.entropy_coeff": ("algorithm.entropy_coef", float),
    "actor_rollout_ref.actor.kl_loss_coef": ("algorithm.kl_coef", float),
    "actor_rollout_ref.actor.kl_loss_type": ("algorithm.kl_type", _kl_type),
    "actor_rollout_ref.actor.clip_ratio_low": ("algorithm.eps_low", float),
    "actor_rollout_ref.actor.clip_ratio_high": ("algorithm.eps_high", float),
    "actor_rollout_ref.actor.clip_ratio_c": ("algorithm.clip_c", float),
    "actor_rollout_ref.actor.loss_agg_mode": ("algorithm.loss_agg_mode", str),
    "actor_rollout_ref.actor.optim.lr": ("optim.actor_lr", float),
    "actor_rollout_ref.actor.optim.betas": ("optim.betas", list),
    "actor_rollout_ref.actor.optim.weight_decay": ("optim.weight_decay", float),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("optim.warmup_steps", lambda v: max(int(v), 0)),
    "critic.optim.lr": ("optim.critic_lr", float),
    "critic.cliprange_value": ("algorithm.value_clip", float),
    "actor_rollout_ref.rollout.max_model_len": ("rollout.max_model_len", int),
    "actor_rollout_ref.rollout.response_length": ("rollout.response_length", int),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", float),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", float),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", int),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.gpu_memory_utilization", float),
    "actor_rollout_ref.rollout.rollout_filter_ratio": ("algorithm.rollout_filter_ratio", float),
    "actor_rollout_ref.rollout.rollout_filter_type": ("algorithm.rollout_filter_type", str),
    "actor_rollout_ref.rollout.rollout_filter_strategy": ("algorithm.rollout_filter_strategy", str),
    "actor_rollout_ref.rollout.rollout_filter_value": ("algorithm.rollout_filter_value", float),
    "actor_rollout_ref.rollout.rollout_filter_metric": ("algorithm.rollout_filter_metric", str),
    "actor_rollout_ref.rollout.rollout_filter_include_zero": ("algorithm.rollout_filter_include_zero", bool),
    "actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode": ("algorithm.rollout_filter_top_p_prob_mode", str),
    "actor_rollout_ref.rollout.rollout_filter_selection_eps": ("algorithm.rollout_filter_selection_eps", float),
    "actor_rollout_ref.rollout.rollout_filter_empty_stop_steps": ("algorithm.rollout_filter_empty_stop_steps", int),
    "actor_rollout_ref.actor.filter_loss_scaling": ("algorithm.filter_loss_scaling", str),
    "actor_rollout_ref.rollout.val_kwargs.temperature": ("rollout.val_temperature", float),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (None, _must_equal(1, "fastpo's vLLM runs TP 1")),
    "enable_response_mask": ("rollout.train_on_observations", lambda v: not bool(v)),
    "grpo_advantage_length_weight": ("algorithm.grpo_length_weight", _bool),
    "actor_rollout_ref.actor.grpo_advantage_length_weight": ("algorithm.grpo_length_weight", _bool),
    "algorithm.zero_task_advantage": ("algorithm.zero_task_advantage", _bool),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", _bool),
    "algorithm.soft_advantage_reweight": ("algorithm.soft_advantage_reweight", _bool),
    "agent_proxy.context_window_mode": ("rollout.context_window_mode", _context_mode),
    "trainer.generations_to_log_to_wandb.val": ("trainer.log_generations", lambda v: max(int(v), 0)),
    "agent_proxy.batch_adjust_mode": ("algorithm.batch_adjust_mode", _adjust_mode),
    "algorithm.gamma": ("algorithm.gamma", float),
    "algorithm.lam": ("algorithm.lam", float),
    "algorithm.high_level_gamma": ("algorithm.gamma_high", float),
    "algorithm.adv_estimator": ("algorithm.adv_estimator", _estimator),
    "algorithm.kl_ctrl.kl_coef": (None, _must_equal(0.0, "fastpo has no KL penalty inside the reward (use "
                                                        "actor_rollout_ref.actor.kl_loss_coef)")),
    "trainer.project_name": ("trainer.wandb_project", str),
    "trainer.experiment_name": ("trainer.run_dir", lambda v: f"runs/{v}"),
    "trainer.save_freq": ("trainer.save_every", _save_every),
    "trainer.total_training_steps": ("trainer.iterations", int),
    # fastpo's checkpoint holds actor and critic together: one count (port() refuses two different ones)
    "trainer.max_actor_ckpt_to_keep": ("trainer.keep_checkpoints", _keep_checkpoints),
    "trainer.max_critic_ckpt_to_keep": ("trainer.keep_checkpoints", _keep_checkpoints),
    "trainer.log_group_rv_table": ("trainer.log_group_rv_table", bool),
    "collapse_detection.compute_freq": ("trainer.collapse_every", _positive),
    "trainer.gradient_analysis_mode": (None, _bool),  # the switch: port() sets gradient_analysis_every 0 when off
    "trainer.gradient_analysis_every": ("trainer.gradient_analysis_every", _non_negative),
    "actor_rollout_ref.rollout.gradient_analysis_num_buckets": ("trainer.gradient_analysis_num_buckets", _positive),
    "actor_rollout_ref.rollout.gradient_analysis_bucket_mode": ("trainer.gradient_analysis_bucket_mode", _bucket_mode),
    "trainer.gradient_analysis_env_groups": (None, _must_equal(None, "fastpo analyses the training batch; a separate "
                                                                     "analysis rollout is not implemented")),
    "trainer.gradient_analysis_group_size": (None, _must_equal(None, "fastpo analyses the training batch; a separate "
                                                                     "analysis rollout is not implemented")),
    "trainer.gradient_analysis_log_prefilter": (None, _must_equal(False, "fastpo analyses the filtered batch only")),
    "trainer.gradient_analysis_only": (None, _must_equal(False, "fastpo always trains after the analysis")),
    "trainer.exit_after_gradient_analysis": (None, _must_equal(False, "fastpo always trains after the analysis")),
    "collapse_detection.first_turn_enabled": ("trainer.collapse_first_turn", bool),
    "collapse_detection.multi_turn_enabled": ("trainer.collapse_multi_turn", bool),
    "collapse_detection.num_samples": ("trainer.collapse_num_samples", _collapse_samples),
    "trainer.val_before_train": ("trainer.val_before_train", bool),
    "trainer.test_freq": ("trainer.val_every", lambda v: max(int(v), 0)),
    "trainer.validation_steps": (None, _must_equal(1, "fastpo validates val_groups x val_group_size once")),
    "trainer.logger": ("trainer.log_wandb", lambda v: "wandb" in (v if isinstance(v, list) else [v])),
    "agent_proxy.max_context_window": ("rollout.max_context_window", lambda v: -1 if int(v) <= 0 else int(v)),
    "agent_proxy.max_turn": ("env.max_turns", int),
    "agent_proxy.action_sep": ("env.action_sep", str),
    "agent_proxy.max_actions_per_turn": ("env.max_actions_per_turn", int),
    "agent_proxy.use_turn_scores": ("rollout.reward_level", lambda v: "turn" if v else "trajectory"),
    "agent_proxy.enable_think": ("rollout.enable_think", bool),
    "agent_proxy.reward_normalization.method": (None, _must_equal(
        "identity", "fastpo passes the scores to the advantage estimator as they are (RAGEN's identity); "
        "RAGEN's mean_std / asym_clip score normalisation has no fastpo option (grpo's own baseline: "
        "algorithm.grpo_norm)")),
    "es_manager.format_penalty": ("rollout.format_penalty", float),
    "es_manager.train.env_groups": ("env.env_groups", int),
    "es_manager.train.group_size": ("env.group_size", int),
    "es_manager.val.env_groups": ("env.val_groups", int),
    "es_manager.val.group_size": ("env.val_group_size", int),
}

#: RAGEN keys with no effect in fastpo (listed as comments in the output), with the reason.
INERT: dict[str, str] = {
    "micro_batch_size_per_gpu": "fastpo sizes micro-batches by tokens (optim.micro_batch_tokens)",
    "log_prob_micro_batch_size_per_gpu": "token-budget micro-batches (optim.micro_batch_tokens)",
    "actor_rollout_ref.rollout.name": "RAGEN's generation engine; fastpo's is rollout.engine (hf, its built-in "
                                      "engine, by default; vllm where installed)",
    "actor_rollout_ref.rollout.load_format": "how vLLM loads weights; fastpo's engine takes the actor's weights",
    "hydra.searchpath": "where Hydra finds verl's default files; fastpo does not read them (docs/RAGEN.md)",
    "actor_rollout_ref.actor.micro_batch_size_per_gpu": "token-budget micro-batches (optim.micro_batch_tokens)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "token-budget micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "token-budget micro-batches",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "token-budget micro-batches",
    "critic.ppo_micro_batch_size_per_gpu": "token-budget micro-batches",
    "collapse_detection.micro_batch_size": "token-budget micro-batches (optim.micro_batch_tokens)",
    "critic.ppo_mini_batch_size": "the critic steps on the actor's mini-batches (optim.mini_batch_size)",
    "critic.model.lora_rank": "the critic uses model.lora_rank", "critic.model.lora_alpha": "model.lora_alpha",
    "critic.model.target_modules": "model.lora_target_modules",
    "critic.optim.betas": "optim.betas serves actor and critic",
    "actor_rollout_ref.actor.use_ref": "the reference model is loaded only when algorithm.kl_coef > 0",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_coef > 0 turns the KL loss on",
    "actor_rollout_ref.rollout.prompt_length": "unused by RAGEN too",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM scheduler setting, not exposed",
    "actor_rollout_ref.rollout.enforce_eager": "vLLM setting, not exposed",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM sleeps during the update on GPU",
    "actor_rollout_ref.rollout.tp_size_check": "TP is 1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "validation samples at rollout.val_temperature (0 = greedy)",
    "algorithm.bi_level_gae": "mapped with algorithm.adv_estimator (true -> bilevel_gae)",
    "algorithm.kl_penalty": "no in-reward KL (algorithm.kl_ctrl.kl_coef must be 0)",
    "algorithm.kl_ctrl.type": "no in-reward KL",
    "agent_proxy.reward_normalization.grouping": "no effect with method identity",
    "system.CUDA_VISIBLE_DEVICES": "choose GPUs with CUDA_VISIBLE_DEVICES / torchrun",
    "trainer.n_gpus_per_node": "launch with torchrun --nproc_per_node N",
    "trainer.local_log_dir": "logs go to trainer.run_dir",
    "trainer.wandb_id": "fastpo resumes the W&B run whose id it keeps in <run_dir>/wandb_run_id; a run id from "
                        "the config is not read",
    "trainer.generations_to_log_to_wandb.train": "fastpo logs validation generations only (trainer.log_generations)",
    "data.max_prompt_length": "unused", "data.max_response_length": "unused", "data.train_batch_size": "unused",
    "ctx_manager.generation.gen_config.response_length": "= rollout.response_length",
    "ctx_manager.generation.gen_config.temperature": "= rollout.temperature",
    "ctx_manager.generation.gen_config.top_p": "= rollout.top_p", "ctx_manager.generation.gen_config.top_k":
        "= rollout.top_k", "ctx_manager.generation.gen_config.kwargs": "unused",
}

# ---- RAGEN-2's diagnostics and checkpoint counts: fastpo's side is being added. One table, so that each entry
# moves to KEY_MAP (or INERT) when its fastpo field exists.
#: Top-level keys of RAGEN's configs (a --config with one of them as a section is a RAGEN file, not a fastpo one).
RAGEN_SECTIONS = frozenset(k.split(".")[0] for k in (*KEY_MAP, *INERT) if "." in k)


def ragen_equivalents(name: str) -> tuple[str, list[str]]:
    """(RAGEN's name, the fastpo fields it maps to) for a setting spelled RAGEN's way: a full RAGEN key
    (``actor_rollout_ref.actor.clip_ratio_low``) or its last part under any section (``algorithm.clip_ratio_low``,
    ``clip_ratio_low``), looked up in :data:`KEY_MAP`; ``(name, [])`` when it is not a RAGEN name."""
    key = name.lstrip("-")
    short = key.rsplit(".", 1)[-1]
    if key in KEY_MAP:
        fields = [KEY_MAP[key][0]]
    else:
        fields = [f for k, (f, _) in KEY_MAP.items() if k.rsplit(".", 1)[-1] == short]
    return short, sorted({f for f in fields if f})
