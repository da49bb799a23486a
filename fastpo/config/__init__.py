"""fastpo configuration: nested dataclasses (a docstring under every field), each section's own checks, the config
hash. A leaf package: it imports nothing from the rest of fastpo, so every part can read it and none can break
importing it.

    cfg = Config(); cfg.algorithm.eps_high = 0.3
    cfg.env.check(world_size=8)           # one line per bad field of a section ([] when all is well)
    cfg.cross_checks(world_size=8)        # the rules that tie sections together
    text = to_json(cfg)
    config_hash(cfg)                      # over the fields that change the math; checked on resume

Built elsewhere on top of it: ``fastpo.presets`` (the named presets), ``fastpo.config_load`` (``parse_args``:
defaults < ``--preset NAME`` < ``--config file.yaml`` < ``--section.field value`` flags; ``from_json``),
``fastpo.preflight`` (``validate``: field types, these checks, then the ones that need the env registry, the
algorithm registries and the file system). ``--help`` prints every field with its docstring: the sections
(``fastpo.config.sections``) are the only place the config is documented. ``fastpo.config.messages`` holds
ConfigError and the bounded text of values in messages.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from .messages import SHOWN_LIMIT, ConfigError, failed, shown, shown_text
from .sections import (
    INT64_MAX,
    MAX_REFILL_ROUNDS,
    MAX_STALENESS,
    PREFLIGHT_TIMEOUT_S,
    AlgorithmConfig,
    EnvConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "INT64_MAX", "MAX_REFILL_ROUNDS", "MAX_STALENESS", "PREFLIGHT_TIMEOUT_S", "SHOWN_LIMIT", "SECTIONS",
    "AlgorithmConfig", "Config", "ConfigError", "EnvConfig", "ModelConfig", "OptimConfig", "RolloutConfig",
    "TrainerConfig", "all_fields", "config_hash", "failed", "field_types", "is_field", "shown", "shown_text",
    "to_dict", "to_json",
]


# EvalArgs / SFTArgs (eval.py, sft.py) nest sections alike: same shape, each entry point's own subset of sections.
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

    def cross_checks(self, world_size: int = 1) -> list[str]:
        """One line per broken rule between sections for `world_size` ranks (each section's own fields:
        its ``check()``); [] when all is well."""
        e, r, a, o, t = self.env, self.rollout, self.algorithm, self.optim, self.trainer
        group_size = e.smallest_group_size()
        # vLLM seeds numpy's global RNG with trainer.seed + rank (np.random.seed: < 2**32); torch generators: int64
        seed_max = (2**32 - 1 if r.engine == "vllm" else INT64_MAX) - (world_size - 1)
        checks = [
            (not r.partial or a.refill_rounds == 0, f"rollout.partial=true cannot be combined with "
                                                    f"algorithm.refill_rounds={a.refill_rounds}; set one of them"),
            (a.old_logprobs == "trainer" or not r.train_on_observations,
             "algorithm.old_logprobs=engine needs rollout.train_on_observations=false: observation tokens are not "
             "sampled, so the engine has no logprob for them"),
            (a.offpolicy_correction == "none" or not r.train_on_observations,
             f"algorithm.offpolicy_correction={a.offpolicy_correction} needs rollout.train_on_observations=false: "
             f"observation tokens are not sampled, so they have no sampler logprob to correct with"),
            (a.offpolicy_correction == "none" or not r.canonical,
             f"algorithm.offpolicy_correction={a.offpolicy_correction} needs rollout.canonical=false: the canonical "
             f"rewrite is not what was sampled, so its sampler logprobs are not exact"),
            (a.adv_estimator not in ("grpo", "rloo", "gigpo") or (a.adv_estimator == "grpo" and a.grpo_norm != "group")
             or group_size >= 2,
             f"env.group_size must be >= 2 for algorithm.adv_estimator={a.adv_estimator!r} (a group of one has zero "
             f"advantage), got {group_size} (env.group_size or an env.train entry's group_size)"),
            (o.micro_batch_tokens >= r.max_model_len, f"optim.micro_batch_tokens ({o.micro_batch_tokens}) must be >= "
             f"rollout.max_model_len ({r.max_model_len}) so one trajectory fits"),
            (t.seed <= seed_max, f"trainer.seed must be <= {seed_max} (trainer.seed + rank seeds "
             f"{'vLLM (numpy: < 2**32)' if r.engine == 'vllm' else 'torch (int64)'}), got {t.seed}"),
            # the gradient analysis splits the ppo loss into its terms, on-policy
            (t.gradient_analysis_every == 0 or a.policy_loss == "ppo",
             f"trainer.gradient_analysis_every={t.gradient_analysis_every} needs algorithm.policy_loss ppo (its terms "
             f"are split), got {a.policy_loss!r}"),
            (t.gradient_analysis_every == 0 or a.offpolicy_correction == "none",
             f"trainer.gradient_analysis_every={t.gradient_analysis_every} needs algorithm.offpolicy_correction none, "
             f"got {a.offpolicy_correction!r}"),
            # the collapse diagnostics score thoughts under the prompts of one group
            (t.collapse_every == 0 or r.enable_think,
             f"trainer.collapse_every={t.collapse_every} needs rollout.enable_think=true: the diagnostics score the "
             f"thoughts (or collapse_every 0: off)"),
            (t.collapse_every == 0 or r.max_context_window == -1,
             f"trainer.collapse_every={t.collapse_every} needs rollout.max_context_window -1 (full context), got "
             f"{r.max_context_window}: a limited window gives the turns of a group different prompts (or "
             f"collapse_every 0: off)"),
            (t.collapse_every == 0 or r.context_window_mode == "full",
             f"trainer.collapse_every={t.collapse_every} needs rollout.context_window_mode full, got "
             f"{r.context_window_mode} (RAGEN-2 computes the collapse metrics on the full context only; or "
             f"collapse_every 0: off)"),
            # per-turn training sequences: group statistics over episodes (grpo) are computed per episode; GiGPO's
            # step groups and the entropy filter read whole-episode sequences, which these modes do not train on
            (r.context_window_mode == "full" or a.adv_estimator != "gigpo",
             f"algorithm.adv_estimator=gigpo needs rollout.context_window_mode full, got {r.context_window_mode}"),
            (r.context_window_mode == "full" or "entropy" not in a.rollout_filter_metric,
             f"algorithm.rollout_filter_metric={a.rollout_filter_metric} needs rollout.context_window_mode full, got "
             f"{r.context_window_mode} (the entropy is scored on whole-episode sequences)"),
        ]
        return failed(checks) + self.train_seed_errors()

    def train_seed_errors(self) -> list[str]:
        """The last training group's env seed, train_seed + (iterations + 1) * env_groups - 1, must fit in int64 (env
        seeds reach numpy and C++ as int64). The message leads with the larger of the two terms: a huge
        trainer.iterations was blamed on env.train_seed, with a negative bound. [] when it fits."""
        e, iterations = self.env, max(self.trainer.iterations, 0)
        groups, seed = max(e.env_groups, 1), max(e.train_seed, 0)
        span = (iterations + 1) * groups  # seeds the run draws from train_seed on
        if seed + span - 1 <= INT64_MAX:
            return []
        why = f"the seed counter advances by env.env_groups ({e.env_groups}) per iteration and env seeds are int64"
        most_iterations = (INT64_MAX - seed + 1) // groups - 1
        if span > seed and most_iterations >= 0:
            return [f"trainer.iterations ({self.trainer.iterations}) must be <= {most_iterations} with env.train_seed "
                    f"({e.train_seed}): {why}"]
        if span <= seed:
            return [f"env.train_seed ({e.train_seed}) must be <= {INT64_MAX - span + 1} with trainer.iterations "
                    f"({self.trainer.iterations}): {why}"]
        return [f"env.train_seed ({e.train_seed}) must be <= {INT64_MAX - groups + 1} (room for one iteration) and "
                f"trainer.iterations ({self.trainer.iterations}) far lower: {why}"]

    def nonfinite_errors(self) -> list[str]:
        """NaN in any float field, or +-inf in one not listed in :data:`INF_OK`; one line per field."""
        errors = []
        for section in dataclasses.fields(self):
            obj = getattr(self, section.name)
            if not dataclasses.is_dataclass(obj):  # a tool's own option beside the sections (bench/diagnose_groups.py)
                continue
            for f in dataclasses.fields(obj):
                value, name = getattr(obj, f.name), f"{section.name}.{f.name}"
                for v in value if isinstance(value, tuple) else (value,):
                    if not isinstance(v, float) or math.isfinite(v):
                        continue
                    if math.isnan(v) or name not in INF_OK:
                        allowed = "a finite number or inf" if name in INF_OK else "a finite number"
                        errors.append(f"{name} must be {allowed}, got {shown(value)}")
                        break
        return errors


#: Float fields whose docstring says "inf disables"; NaN is refused everywhere.
INF_OK = frozenset({"algorithm.clip_c", "trainer.entropy_jump_factor", "trainer.grad_norm_spike_factor",
                    "trainer.logprob_gap_max", "algorithm.is_cap", "algorithm.is_mask_high", "env.preflight_timeout_s"})

SECTIONS = tuple(f.name for f in dataclasses.fields(Config))

# ------------------------------------------------------------------------------------- field introspection
@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved type of every dataclass field (ClassVars excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _section_cls(section: str) -> type:
    return typing.get_type_hints(Config)[section]


def field_types(section: str) -> dict[str, Any]:
    """Resolved type of every field of the section named `section` (``"env"``, ...), by field name."""
    return _field_types(_section_cls(section))


def all_fields() -> list[str]:
    """Every dotted field name, ``section.field``."""
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(_section_cls(s))]


def is_field(dotted: str) -> bool:
    """Whether ``section[.field]`` names a trainer config section or field (other entry points skip these when
    they read a run's config.json)."""
    section, _, key = dotted.partition(".")
    cls = _section_cls(section) if section in SECTIONS else None
    return cls is not None and (not key or key in _field_types(cls) or key in getattr(cls, "_renamed", {}))


# ---------------------------------------------------------------------------------------------- serialise
def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict (tuples stay tuples; to_json writes them as lists)."""
    return {s: {f.name: getattr(getattr(cfg, s), f.name) for f in dataclasses.fields(getattr(cfg, s))}
            for s in SECTIONS}


def to_json(cfg: Config) -> str:
    """The full config as indented, key-sorted JSON (non-finite floats as Infinity / NaN)."""
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


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
    ("algorithm", "batch_adjust_mode"): "none", ("rollout", "context_window_mode"): "full",
    ("rollout", "partial_kv"): "recompute", ("rollout", "partial_interrupt"): False, ("rollout", "partial_spare"): 0,
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
