"""Supervised fine-tuning on solver trajectories, rendered in exactly RAGEN's multi-turn chat format: the command line
over ``fastpo.sft_core`` (the data and the training loop).

    # non-slippery FrozenLake, answer-only, 2 actions per turn (how the tiny agent was taught), then evaluate
    python -m fastpo.sft --model.path fastpo/assets/tiny-agent --env.names frozenlake \
        --env.kwargs '{"is_slippery": false}' --rollout.enable_think false --env.max_actions_per_turn 2 \
        --sft.steps 300 --sft.out runs/sft_fl
    python -m fastpo.eval --model.path runs/sft_fl --env.names frozenlake --env.kwargs '{"is_slippery": false}' \
        --rollout.enable_think false --env.max_actions_per_turn 2
    # RAGEN's SFT baseline (1,000 BFS trajectories on Sokoban), Qwen2.5-0.5B-Instruct on a GPU
    python -m fastpo.sft --model.path Qwen/Qwen2.5-0.5B-Instruct --env.names sokoban --sft.episodes 1000 \
        --sft.noise 0 --sft.steps 500 --sft.lr 1e-5 --sft.batch_size 16 --sft.micro_batch_size 4 \
        --model.dtype bfloat16 --sft.out runs/sft_sokoban

One process; deterministic given ``sft.seed``. The output is a Hugging Face model dir plus ``sft_args.json`` and
``sft_log.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from . import distributed as dist_utils
from .cli import parse
from .cli_schema import describe, subset
from .config import ConfigError, EnvConfig, ModelConfig, RolloutConfig, failed, is_field
from .progress import write
from .sft_core import DEFAULT_SFT_SEED, generate_episodes, tokenize_episode, train_sft


@dataclass
class SFTConfig:
    """Data and optimisation of the fine-tuning."""

    out: str = ""
    """Output folder: a Hugging Face model dir plus sft_args.json and sft_log.jsonl (required)."""
    episodes: int = 4000
    """Solver episodes to generate (>= 1), split equally among env.names."""
    noise: float = 0.3
    """Probability that a planned action is replaced by a random one, in [0, 1] (the data then shows recovery
    states)."""
    turn_length: Literal["uniform", "max"] = "uniform"
    """Actions per turn: uniform in 1..env.max_actions_per_turn, or always the max."""
    steps: int = 300
    """Optimiser steps (>= 1)."""
    lr: float = 2e-3
    """Peak learning rate (> 0)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule after the warmup."""
    warmup_steps: int = 0
    """Linear warmup steps (>= 0)."""
    weight_decay: float = 0.01
    """AdamW weight decay (>= 0)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (> 0)."""
    batch_size: int = 32
    """Sequences per optimiser step (>= 1)."""
    micro_batch_size: int = 0
    """Sequences per forward (>= 1; 0 = batch_size); gradients accumulate over the micro-batches."""
    seed: int = DEFAULT_SFT_SEED
    """First env seed of the generated episodes (>= 0; the default keeps clear of the validation seeds 123..378);
    also the shuffle seed."""
    save_every: int = 0
    """Also save <out>/step-K every K steps (>= 0; 0 = only the end)."""
    log_every: int = 10
    """Console / sft_log.jsonl line every N steps (>= 1)."""
    device: str = ""
    """Torch device; "" = cuda when available, else cpu."""

    def check(self, num_envs: int = 1) -> list[str]:
        """One line per bad field of this section, for data split among `num_envs` envs; [] when all is well."""
        return failed([
            (bool(self.out), "sft.out: required (the output folder)"),
            (self.episodes >= num_envs,
             f"sft.episodes must be >= the number of envs ({num_envs}), got {self.episodes}"),
            (0.0 <= self.noise <= 1.0, f"sft.noise must lie in [0, 1], got {self.noise}"),
            (self.steps >= 1, f"sft.steps must be >= 1, got {self.steps}"),
            (self.lr > 0 and math.isfinite(self.lr), f"sft.lr must be a finite number > 0, got {self.lr}"),
            (self.warmup_steps >= 0, f"sft.warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.weight_decay >= 0, f"sft.weight_decay must be >= 0, got {self.weight_decay}"),
            (self.grad_clip > 0, f"sft.grad_clip must be > 0, got {self.grad_clip}"),
            (self.batch_size >= 1, f"sft.batch_size must be >= 1, got {self.batch_size}"),
            (self.micro_batch_size >= 0,
             f"sft.micro_batch_size must be >= 0 (0 = batch_size), got {self.micro_batch_size}"),
            (self.seed >= 0, f"sft.seed must be >= 0, got {self.seed}"),
            (self.save_every >= 0, f"sft.save_every must be >= 0 (0: save only at the end), got {self.save_every}"),
            (self.log_every >= 1, f"sft.log_every must be >= 1, got {self.log_every}"),
        ])


SFTModel = subset(ModelConfig, "path", "dtype", defaults={"dtype": "float32"}, name="SFTModel",
                  doc="The model to fine-tune (its tokenizer must have a chat template).")
SFTEnv = subset(EnvConfig, "names", "kwargs", "plugins", "backend", "max_turns", "max_actions_per_turn",
                name="SFTEnv", doc="The envs whose solver writes the episodes (each with its own action budget).",
                docs={"names": "Envs to write episodes for (fastpo.envs.available() names with a solver: sokoban*, "
                               "frozenlake, bandit*, countdown, or a plug-in's); sft.episodes is split equally."})
SFTRollout = subset(RolloutConfig, "enable_think", name="SFTRollout", doc="The answer format.")


@dataclass
class SFTArgs:
    """``python -m fastpo.sft``: the trainer's model / env / rollout flags plus the fine-tuning's own."""

    model: SFTModel = field(default_factory=SFTModel)
    """The model to fine-tune."""
    env: SFTEnv = field(default_factory=SFTEnv)
    """The envs whose solver writes the episodes."""
    rollout: SFTRollout = field(default_factory=SFTRollout)
    """The answer format."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Data and optimisation."""

    def check(self) -> list[str]:
        """One line per bad field of every section (the env names against the registry: when the run starts); []
        when all is well. The model / env sections are subsets of the trainer's, whose checks need a whole Config,
        so their few fields are checked here."""
        e = self.env
        return (failed([(bool(self.model.path), "model.path: required (a model folder or hub id)"),
                        (len(e.names) >= 1, "env.names: give at least one env")])
                + self.sft.check(len(e.names))
                + failed([(e.max_turns >= 1, f"env.max_turns must be >= 1, got {e.max_turns}"),
                          (e.max_actions_per_turn >= 1,
                           f"env.max_actions_per_turn must be >= 1, got {e.max_actions_per_turn}")]))


def validate_args(args: SFTArgs) -> SFTArgs:
    """Range checks of every field (:meth:`SFTArgs.check`), before anything is built; ConfigError naming each bad
    one."""
    errors = args.check()
    if errors:
        raise ConfigError("\n".join(errors))
    return args


def parse_args(argv: Sequence[str] | None = None) -> SFTArgs:
    """``SFTArgs`` from the command line (``fastpo.cli``: ``--config FILE`` < flags), validated."""
    description = describe("Supervised fine-tuning on solver trajectories, in RAGEN's multi-turn chat format.",
                           "Settings: --config FILE.yaml < --section.field VALUE flags; a run's config.json works.")
    return validate_args(parse(SFTArgs, argv, prog="python -m fastpo.sft", description=description, known=is_field))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: build the dataset, train, save; bad input exits with one ``error:`` line per problem (status
    2)."""
    from fastpo.envs.text import TextEnvError

    from .log import console

    console()  # the library's messages on the console
    try:
        args = parse_args(argv)
        return _run(args)
    except (ConfigError, ValueError, ImportError, TextEnvError) as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2


def _save(model: Any, tokenizer: Any, out: str) -> None:
    """A Hugging Face model dir (generation-ready: the tokenizer pads on the left)."""
    model.save_pretrained(out, safe_serialization=True)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(out)
    tokenizer.padding_side = side


def _run(args: SFTArgs) -> int:
    from fastpo import envs
    from fastpo.model import load_policy, load_tokenizer
    from fastpo.model_path import resolve_model_path

    s, e = args.sft, args.env
    if dist_utils.is_distributed() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("fastpo.sft runs in a single process; launch it with python -m fastpo.sft, not torchrun")
    envs.load_plugins(list(e.plugins))
    for name in e.names:
        if name.lower() not in envs.available():
            raise ValueError(f"env.names: unknown env {name!r}; accepted: {envs.available()}")
    torch.manual_seed(s.seed)
    path = resolve_model_path(args.model.path)  # "tiny", a run folder (its hf/), a model folder or a hub id
    tokenizer = load_tokenizer(path, padding_side="right")
    think = args.rollout.enable_think
    t0 = time.perf_counter()
    episodes = []
    for k, name in enumerate(e.names):  # an equal share each, on disjoint seed ranges
        share = s.episodes // len(e.names) + (1 if k < s.episodes % len(e.names) else 0)
        episodes += generate_episodes(
            name, share, seed=s.seed + k * s.episodes, noise=s.noise, max_actions_per_turn=e.max_actions_per_turn,
            max_turns=e.max_turns, enable_think=think, env_kwargs=dict(e.kwargs), turn_length=s.turn_length,
            backend=e.backend,
        )  # fmt: skip
    data = [tokenize_episode(tokenizer, ep, think) for ep in episodes]
    n_actions = sum(len(a) for ep in episodes for a in ep.actions)
    n_random = sum(sum(r) for ep in episodes for r in ep.random)
    lengths = [len(ids) for ids, _ in data]
    print(
        f"data: {len(data)} episodes of {','.join(e.names)} in {time.perf_counter() - t0:.1f}s; success"
        f" {np.mean([ep.success for ep in episodes]):.3f}, random actions {n_random}/{n_actions}"
        f" ({n_random / max(1, n_actions):.3f}), tokens/seq mean {np.mean(lengths):.0f} max {max(lengths)}"
    )
    device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_policy(path, dtype=args.model.dtype).to(device)
    os.makedirs(s.out, exist_ok=True)
    log_path = os.path.join(s.out, "sft_log.jsonl")
    with open(log_path, "w") as log_file:

        def log(row: dict[str, float]) -> None:
            write(
                f"step {row['step']:5d} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | lr"
                f" {row['lr']:.2e} | {row['elapsed_s']:.1f}s"
            )
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()

        def snapshot(step: int) -> None:
            _save(model, tokenizer, os.path.join(s.out, f"step-{step}"))
            write(f"saved {s.out}/step-{step}")

        train_sft(
            model, data, s.steps, lr=s.lr, batch_size=s.batch_size, micro_batch_size=s.micro_batch_size or None,
            pad_token_id=tokenizer.pad_token_id, seed=s.seed, schedule=s.schedule,
            warmup_steps=s.warmup_steps, weight_decay=s.weight_decay, grad_clip=s.grad_clip,
            log_every=s.log_every, log=log, save_every=s.save_every, save=snapshot, progress=True,
        )  # fmt: skip
    _save(model, tokenizer, s.out)
    with open(os.path.join(s.out, "sft_args.json"), "w") as f:
        json.dump({**dataclasses.asdict(args), "num_sequences": len(data)}, f, indent=2)
    print(f"saved {s.out} (eval: python -m fastpo.eval --model.path {s.out} --env.names {','.join(e.names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
