"""The named presets (``--preset NAME``): RAGEN's settings per env and the embedded CPU default, each a function
returning a fresh Config, registered in :data:`PRESETS` with ``@register_preset("name")``.

    cfg = get_preset("tiny")      # ConfigError listing the presets for an unknown name

The registry is defined here, beside the presets themselves, so it is complete whenever it can be read
(``fastpo.config`` stays a leaf that imports nothing of fastpo).
"""

from __future__ import annotations

from collections.abc import Callable

from .cli import did_you_mean
from .config import Config, ConfigError

#: Preset name -> a zero-argument function returning a fresh Config.
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
                          f"{did_you_mean(name, PRESETS)}")
    return PRESETS[name]()


@register_preset("sokoban")
def sokoban() -> Config:
    """RAGEN StarPO-S on SimpleSokoban: Qwen2.5-0.5B-Instruct, 8 x 16, std filter 0.25, PPO + critic, clip 0.2 /
    0.28, dual clip 3, entropy 0.001, no KL, lr 1e-6 / 1e-5, 200 iterations, 256 val seeds at T 0.5 every 10."""
    return Config()


@register_preset("frozenlake")
def frozenlake() -> Config:
    """RAGEN StarPO-S on slippery 4x4 FrozenLake (otherwise the sokoban preset)."""
    cfg = Config()
    cfg.env.names = ("frozenlake",)
    return cfg


@register_preset("bandit")
def bandit() -> Config:
    """RAGEN bi-arm Bandit: one turn, one action, 500-token answers; validated on 256 train-name + 256 test-name
    (Trader / Librarian) instances."""
    cfg = Config()
    cfg.env.names = ("bandit",)
    cfg.env.max_turns, cfg.env.max_actions_per_turn, cfg.env.max_actions_per_traj = 1, 1, 1
    cfg.env.val_names, cfg.env.val_groups = ("bandit", "bandit_test"), 512
    cfg.rollout.response_length = 500
    return cfg


@register_preset("countdown")
def countdown() -> Config:
    """RAGEN Countdown: one turn, one equation."""
    cfg = Config()
    cfg.env.names = ("countdown",)
    cfg.env.max_turns, cfg.env.max_actions_per_turn, cfg.env.max_actions_per_traj = 1, 1, 1
    return cfg


@register_preset("starpo-vanilla")
def starpo_vanilla() -> Config:
    """Vanilla StarPO (paper baseline) on Sokoban: no rollout filter, KL 0.001 (k1), symmetric clip 0.2."""
    cfg = Config()
    cfg.algorithm.rollout_filter_ratio = 1.0
    cfg.algorithm.kl_coef, cfg.algorithm.kl_type = 0.001, "k1"
    cfg.algorithm.eps_low = cfg.algorithm.eps_high = 0.2  # mini-batch stays 32 (RAGEN): 4 optimizer steps / iteration
    return cfg


@register_preset("grpo")
def grpo() -> Config:
    """StarPO-S with GRPO advantages (no critic) on Sokoban."""
    cfg = Config()
    cfg.algorithm.adv_estimator = "grpo"
    return cfg


@register_preset("tiny")
def tiny() -> Config:
    """The embedded default (``make demo``): the shipped tiny CPU agent (``fastpo.tiny_agent``) trained with StarPO-S
    with GiGPO advantages (episode-level group advantage + step-level advantage over anchor states, w 1, step
    discount 0.95; std filter keeping half the groups, clip 0.2 / 0.28, no KL) on non-slippery FrozenLake 4x4: 16
    groups x 8 rollouts per iteration, 5 turns of at most 2 actions, answer-only prompts (the agent is too small to
    use a thought), turns end at ``</answer>``, sampling at temperature 0.7, 4 PPO steps per iteration (shuffled
    mini-batches of 16 of the 64 kept trajectories) at lr 3e-4, 150 iterations, validation on 256 fixed states at
    temperature 0.5 before training and every 30 iterations. ~3.7 s per iteration on 2 CPU cores (2 ranks; ~10
    min for the run, docs/RESULTS.md has the measured wall time and gain), up to ~2x that on a slow hour of the
    project's VM. Why these
    settings (each measured, docs/results/log.md):
    without the stop string the answers grew text after ``</answer>`` that parsing ignores but training reinforces;
    at temperature 1 the 0.6M-parameter model's long tail of invalid tokens kept entropy and format errors climbing;
    in-order mini-batches held 2 groups each; over 3 training seeds GiGPO gained +14.9 points on average, GRPO
    +12.8, GAE +16.4 (differences within the seed spread; GiGPO needs no critic and costs 0.04% of an iteration); lr
    1e-3 fits the 10-minute budget with 100 iterations but its validation swings by 10-15 points between evaluations
    (+14.1 and +2.0 on two runs). Padded micro-batches: shuffled mini-batches of 16 rarely hold two trajectories of
    a group, so the shared layout saves nothing here (update 1.19 vs 1.22 s per iteration). Gradients of a
    mini-batch are reduced once across ranks (``optim.defer_grad_sync``), and PPO's old logprobs come from the sampler
    (``algorithm.old_logprobs = "engine"``, no scoring forward)."""
    cfg = Config()
    cfg.model.path, cfg.model.dtype, cfg.model.gradient_checkpointing = "tiny", "float32", False
    cfg.env.names, cfg.env.kwargs = ("frozenlake",), {"is_slippery": False}
    cfg.env.env_groups, cfg.env.group_size, cfg.env.val_groups = 16, 8, 256
    cfg.env.max_actions_per_turn = 2
    cfg.rollout.enable_think = False
    cfg.rollout.response_length, cfg.rollout.max_model_len = 16, 1024
    cfg.rollout.stop, cfg.rollout.temperature = ("</answer>",), 0.7
    cfg.algorithm.adv_estimator, cfg.algorithm.rollout_filter_ratio = "gigpo", 0.5
    cfg.optim.actor_lr, cfg.optim.mini_batch_size, cfg.optim.micro_batch_tokens = 3e-4, 16, 1024
    cfg.optim.micro_batch_layout = "padded"
    # One gradient reduction per optimiser step on 2 ranks (-19% per iteration, measured); the 0.6M-parameter model
    # has no memory reason to stay sharded. A no-op on 1 process, so 1-process results are unchanged by it.
    cfg.optim.defer_grad_sync = True
    # PPO's old logprobs from the sampler: the built-in engine scores the same weights with the same kernels, so the
    # trainer's scoring forward (~17% of an iteration) is skipped; the gap guard on the first step checks the match.
    cfg.algorithm.old_logprobs = "engine"
    # every 30 (6 validations of ~3.1 s instead of 16): the run fits its 10 minutes; training is unchanged by it
    # (sampling is seeded per request, mini-batches by seed / step / epoch)
    cfg.trainer.iterations, cfg.trainer.val_every, cfg.trainer.save_every = 150, 30, 0
    cfg.trainer.run_dir = "runs/tiny"
    return cfg


@register_preset("metamathqa")
def metamathqa() -> Config:
    """RAGEN MetamathQA (_5_metamathqa): one answer per question ("You have 1 actions left"), otherwise the sokoban
    preset. fastpo reads a local file: add --env.kwargs '{"data_path": "MetaMathQA-395K.json"}' (JSON array or
    JSONL; docs/ENVS.md)."""
    cfg = Config()
    cfg.env.names = ("metamathqa",)
    cfg.env.max_actions_per_traj = 1
    return cfg


@register_preset("sokoban-lora")
def sokoban_lora() -> Config:
    """RAGEN base-lora on SimpleSokoban: the sokoban preset with LoRA rank 64, alpha 64 on all linear layers, actor lr
    1e-5, critic lr 1e-4."""
    cfg = Config()
    cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules = 64, 64, "all-linear"
    cfg.optim.actor_lr, cfg.optim.critic_lr = 1e-5, 1e-4
    return cfg
