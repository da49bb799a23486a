"""Supervised fine-tuning on solver trajectories, rendered in exactly RAGEN's multi-turn chat format: the library
under ``python -m fastpo.sft`` (its command line, ``fastpo.sft``) and ``fastpo.tiny_agent`` (the shipped agent's
recipe).

    from fastpo.sft_core import build_sft_dataset, train_sft
    data = build_sft_dataset("sokoban", n=1000, seed=100_000, noise=0.3, tokenizer=tok)   # [(input_ids, loss_mask)]
    losses = train_sft(model, data, steps=300, lr=2e-3, batch_size=32, pad_token_id=tok.pad_token_id)

Data (``generate_episodes``): instance i has env seed ``seed + i``. Each turn the solver plans from the current
state (``env.solve()``: Sokoban BFS, FrozenLake shortest path, Bandit its high-risk arm, Countdown the generated
solution), the turn's action count is drawn, and each planned action is replaced with probability ``noise`` by a
random one, which ends the turn (the next turn re-plans from wherever it led). The assistant message is RAGEN's
canonical rewrite (``<think>{thought}</think><answer>A || B</answer>``, ``THOUGHTS``); the loss mask covers the
assistant contents and the template's end-of-turn token after each. Training (``train_sft``): AdamW, cosine or
constant lr with optional warmup, grad-norm clip, token-mean cross entropy, gradient accumulation. One process;
deterministic given the seed. It loads no model itself (the caller passes one), so building the tiny agent never
needs ``fastpo.model``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fastpo.envs.bandit import ACTION_HI, ACTION_LO

from .chat_tokens import chat_sequence
from .progress import progress_bar
from .prompts import EnvPromptSpec, Turn, build_messages, env_prompt_spec, turn_reward
from .rollout import _step_subset

#: The second key word of the SFT random streams (the noise and action-count draws of ``generate_episodes``, the
#: batch draws of ``train_sft``), next to the seed: a fixed arbitrary constant that keeps them apart from any other
#: stream seeded with the same number. Changing it changes every SFT dataset and the tiny agent's rebuild.
SFT_STREAM = 0x5F7

#: The thought written in every assistant message, per env kind.
THOUGHTS = {
    "sokoban": "I should push the box onto the target.",
    "frozenlake": "I should avoid the holes and go to the goal.",
    "bandit": "The arm whose name suggests bigger risks can pay more.",
    "countdown": "Let me combine the numbers to reach the target.",
}
#: Seed of the first SFT instance by default: clear of the validation seeds (123..378) and RL's train seeds.
DEFAULT_SFT_SEED = 100_000
_OPS = ("+", "-", "*", "/")


@dataclass
class SFTEpisode:
    """One generated expert episode.

    Attributes:
        seed: the env seed of the instance.
        messages: ``build_messages(spec, turns, for_update=True)``: the chat the sequence renders.
        actions: per answered turn, the actions written (ids for grid envs and Bandit, equations for Countdown).
        random: per answered turn, which of those actions were the random (non-plan) ones.
        success: the env's success flag at the end; reward: the sum of the turn rewards.
    """

    seed: int
    messages: list[dict[str, str]]
    actions: list[list[Any]] = field(default_factory=list)
    random: list[list[bool]] = field(default_factory=list)
    success: bool = False
    reward: float = 0.0


#: The thought of a plug-in env (a registered TextEnv with ``expert_actions``).
PLUGIN_THOUGHT = "Let me work out the best action."


def _kind(env: Any) -> str:
    kind = getattr(env, "name", "")
    if kind not in THOUGHTS and callable(getattr(env, "expert_actions", None)):
        return "plugin"
    if kind not in THOUGHTS:
        raise ValueError(f"SFT data needs a solver; env kind {kind!r} has none; accepted: {sorted(THOUGHTS)}")
    return kind


def _plans(env: Any, kind: str) -> list[list[Any] | None]:
    """The expert's action list per instance from the current state (None: no solution)."""
    if kind in ("sokoban", "frozenlake", "bandit"):  # Bandit: the high-risk arm's id, which its split decides
        return env.solve()
    if kind == "plugin":
        return env.expert_actions()
    return [[s] if s is not None else None for s in env.solutions()]


def _random_action(rng: np.random.Generator, kind: str, env: Any, i: int, planned: Any) -> Any:
    """A uniformly drawn action other than ``planned`` (Countdown: a random equation over the numbers)."""
    if kind == "countdown":
        nums = [int(x) for x in env.envs[i].nums]
        order = rng.permutation(len(nums))
        text = str(nums[order[0]])
        for j in order[1:]:
            text += f" {_OPS[int(rng.integers(len(_OPS)))]} {nums[j]}"
        return text
    if kind == "plugin":  # noise needs a vocabulary to draw from (checked in generate_episodes)
        others = [a for a in env.action_vocabulary if a != planned]
        return others[int(rng.integers(len(others)))] if others else planned
    if kind == "bandit":  # the other arm of the instance's own pair: another pair's arm is no pull at all
        others = [planned - ACTION_HI + ACTION_LO]
    else:
        others = [a for a in range(1, len(env.action_names) + 1) if a != planned]
    return others[int(rng.integers(len(others)))]


def _response(kind: str, env: Any, actions: list[Any], spec: EnvPromptSpec, thought: str | None) -> str:
    names = [a if isinstance(a, str) else env.action_names[a - 1] for a in actions]
    answer = f"<answer>{f' {spec.action_sep} '.join(names)}</answer>"
    if not spec.enable_think:
        return answer
    default = THOUGHTS.get(kind, PLUGIN_THOUGHT)
    return f"<think>{default if thought is None else thought}</think>{answer}"


# The episode settings below are also fastpo.eval.evaluate's parameters (alike in shape): each API keeps its own.
def generate_episodes(
    env_name: str,
    n: int,
    seed: int = DEFAULT_SFT_SEED,
    noise: float = 0.0,
    max_actions_per_turn: int = 5,
    max_turns: int = 5,
    enable_think: bool = True,
    thought: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
    backend: str = "default",
    turn_length: str = "uniform",
) -> list[SFTEpisode]:
    """Run ``n`` expert episodes (see the module docstring) and return them in seed order.

    Args:
        env_name: a ``fastpo.envs.available()`` name whose kind has a solver (sokoban*, frozenlake, bandit*,
            countdown).
        n: episodes (>= 1); instance i uses env seed ``seed + i``.
        seed: first env seed; also seeds the noise / action-count draws (deterministic).
        noise: probability, per written action, of a random non-plan action, in [0, 1].
        max_actions_per_turn: actions written per turn are drawn uniformly from 1..this (Bandit / Countdown: 1).
        max_turns: turns per episode at most.
        enable_think: write ``<think>..</think>`` before the answer.
        thought: the think text; None uses ``THOUGHTS[kind]``.
        env_kwargs: keywords for ``fastpo.envs.make`` (e.g. ``{"is_slippery": False}``).
        backend: env backend ("default", "cpp", "python").
        turn_length: actions written per turn: "uniform" (drawn from 1..max_actions_per_turn) or "max" (as many as
            allowed: the answer's length carries no randomness, so every trained token is a function of the
            state, which a tiny model learns much faster).
    """
    from fastpo import envs

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (episodes) must be an int >= 1, got {n!r}")
    if not 0.0 <= float(noise) <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise!r}")
    if turn_length not in ("uniform", "max"):
        raise ValueError(f"turn_length must be 'uniform' or 'max', got {turn_length!r}")
    if max_actions_per_turn < 1 or max_turns < 1:
        raise ValueError(f"need max_actions_per_turn >= 1 and max_turns >= 1, got {max_actions_per_turn}, {max_turns}")
    if not isinstance(env_name, str) or env_name.lower() not in envs.available():
        raise ValueError(f"unknown env name {env_name!r}; accepted: {envs.available()}")
    env = envs.make(env_name, n, backend=backend, **(env_kwargs or {}))
    kind = _kind(env)
    if kind == "plugin" and noise > 0 and not env.action_vocabulary:
        raise ValueError(f"env {env_name!r} takes free text (no action_vocabulary), so SFT cannot draw random "
                         f"actions: use noise 0 (--noise 0), got {noise}")
    spec = env_prompt_spec(env_name, env, enable_think=enable_think)
    per_turn = max(1, min(max_actions_per_turn, int(getattr(env, "max_actions_per_turn", max_actions_per_turn))))
    budget = spec.max_actions_per_traj
    rng = np.random.default_rng([int(seed), SFT_STREAM])
    seeds = np.arange(seed, seed + n, dtype=np.int64)
    render_kw = {"render": False} if kind in ("sokoban", "frozenlake") else {}

    obs = env.reset(seeds)
    turns = [[Turn(o, actions_left=budget)] for o in obs]
    episodes = [SFTEpisode(seed=int(s), messages=[]) for s in seeds]
    active = [True] * n
    used = [0] * n
    for turn in range(max_turns):
        plans = _plans(env, kind)
        written: dict[int, list[Any]] = {}
        for i in range(n):
            plan = plans[i]
            if not active[i] or not plan:
                active[i] = False
                continue
            # at least the share of the plan that still lets the remaining turns finish it
            least = -(-len(plan) // (max_turns - turn))
            drawn = per_turn if turn_length == "max" else int(rng.integers(1, per_turn + 1))
            k = min(max(drawn, least), per_turn, budget - used[i])
            acts, rand = [], []
            for planned in plan[:k]:
                if rng.random() < noise:
                    acts.append(_random_action(rng, kind, env, i, planned))
                    rand.append(True)
                    break
                acts.append(planned)
                rand.append(False)
            written[i] = acts
            episodes[i].actions.append(acts)
            episodes[i].random.append(rand)
            turns[i][-1].response = _response(kind, env, acts, spec, thought)
        if not written:
            break
        rewards: dict[int, list[float]] = {i: [] for i in written}
        stopped: set[int] = set()
        for j in range(max(len(a) for a in written.values())):
            step = {i: a[j] for i, a in written.items() if len(a) > j and i not in stopped}
            if not step:
                break
            _, reward, terminated, truncated, info = _step_subset(env, step, render_kw)
            for i in step:
                rewards[i].append(float(reward[i]))
                episodes[i].success = bool(info["success"][i])
                if terminated[i] or truncated[i]:
                    stopped.add(i)
        obs = env.render()
        for i in written:
            used[i] += len(rewards[i])
            turns[i][-1].reward = turn_reward(rewards[i])
            episodes[i].reward += float(turns[i][-1].reward)
            turns[i].append(Turn(obs[i], actions_left=budget - used[i]))
            if i in stopped or used[i] >= budget:
                active[i] = False
    for ep, history in zip(episodes, turns, strict=True):
        ep.messages = build_messages(spec, history, for_update=True)
    return [ep for ep in episodes if ep.actions]


def tokenize_episode(tokenizer: Any, episode: SFTEpisode, enable_think: bool = True) -> tuple[list[int], list[int]]:
    """``(input_ids [T], loss_mask [T])`` of one episode; the ids decode to ``render_chat(..., for_update=True)``
    and the mask is 1 on each assistant content and the end-of-turn token after it."""
    n_assistant = sum(m["role"] == "assistant" for m in episode.messages)
    ids, mask, _, _ = chat_sequence(tokenizer, episode.messages, [None] * n_assistant, enable_think)
    return ids, mask


def build_sft_dataset(
    env_name: str, n: int, seed: int, noise: float, tokenizer: Any, enable_think: bool = True, **kwargs: Any
) -> list[tuple[list[int], list[int]]]:
    """``n`` expert episodes (``generate_episodes``; ``kwargs`` go there) as ``(input_ids, loss_mask)`` pairs of
    python int lists. Episodes with no answered turn (already solved / unsolvable at the start) are skipped."""
    episodes = generate_episodes(env_name, n, seed, noise, enable_think=enable_think, **kwargs)
    return [tokenize_episode(tokenizer, ep, enable_think) for ep in episodes]


def lr_at(step: int, steps: int, lr: float, schedule: str = "cosine", warmup_steps: int = 0) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warmup, then constant or cosine to 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}; accepted: ['constant', 'cosine']")
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int, device: torch.device) -> tuple:
    """Right-padded ``input_ids, attention_mask, loss_mask`` (``int64 [B, T]``)."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (x, m) in enumerate(batch):
        ids[r, : len(x)] = torch.tensor(x)
        attn[r, : len(x)] = 1
        mask[r, : len(m)] = torch.tensor(m)
    return ids.to(device), attn.to(device), mask.to(device)


def train_sft(
    model: Any,
    dataset: Sequence[tuple[list[int], list[int]]],
    steps: int,
    lr: float = 2e-3,
    batch_size: int = 32,
    micro_batch_size: int | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    schedule: str = "cosine",
    warmup_steps: int = 0,
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    log_every: int = 10,
    log: Callable[[dict[str, float]], None] | None = None,
    save_every: int = 0,
    save: Callable[[int], None] | None = None,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` (any causal LM, on its own device) on ``dataset`` in place.

    Each step draws ``batch_size`` sequences (epoch-wise shuffles from ``seed``), splits them into micro-batches
    of ``micro_batch_size`` (default: all at once) and minimises the cross entropy of every trained token
    (``loss_mask[t] == 1``: token t predicted from the tokens before it), averaged over the batch's trained tokens.
    ``save(k)`` is called after every ``save_every``-th step k (1-based; 0 = never), e.g. to snapshot the model for
    a learning curve; the model is back in train mode afterwards. ``progress``: a bar with the ETA on stderr
    (``fastpo.progress``: when it is a terminal or FASTPO_PROGRESS=1); print from ``log`` with
    ``fastpo.progress.write`` so the lines stay above it.

    Returns:
        the loss of every step (float, before that step's update).
    """
    if not dataset:
        raise ValueError("dataset is empty; generate episodes first (build_sft_dataset)")
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    micro = micro_batch_size or batch_size
    device = next(model.parameters()).device
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.999),
    )
    rng = np.random.default_rng([int(seed), SFT_STREAM])
    order: list[int] = []
    losses: list[float] = []
    model.train()
    bar = progress_bar(steps, desc="sft", unit="step", enabled=None if progress else False)
    t0 = time.perf_counter()
    for step in range(steps):
        while len(order) < batch_size:
            order.extend(rng.permutation(len(dataset)).tolist())
        batch = [dataset[j] for j in order[:batch_size]]
        del order[:batch_size]
        total = sum(sum(m[1:]) for _, m in batch)
        if total == 0:
            raise ValueError("a batch has no trained token; check the loss masks")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, schedule, warmup_steps)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for k in range(0, batch_size, micro):
            ids, attn, mask = _collate(batch[k : k + micro], pad_token_id, device)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / total
            loss.backward()
            step_loss += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if torch.isfinite(grad_norm):
            opt.step()
        losses.append(step_loss)
        if save is not None and save_every > 0 and (step + 1) % save_every == 0 and step + 1 < steps:
            model.eval()
            save(step + 1)
            model.train()
        if log is not None and (step % log_every == 0 or step == steps - 1):
            log(
                {
                    "step": step,
                    "loss": step_loss,
                    "grad_norm": float(grad_norm),
                    "lr": opt.param_groups[0]["lr"],
                    "trained_tokens": float(total),
                    "elapsed_s": time.perf_counter() - t0,
                }
            )
        bar.update(1)
    bar.close()
    model.eval()
    return losses
