"""What one RL iteration sees: roll out a config's training groups, then show the group rewards, which groups the
rollout filter keeps, each kept trajectory's actions and rewards, and the advantage each estimator would give it,
with the sums that decide the direction of the update (docs/results/log.md, "Why RL lost on Sokoban").

    python bench/diagnose_groups.py --preset tiny --model.path runs/sok-sft/step-200 --env.names sokoban \\
        --env.kwargs '{}' --iterations 2                     # the flags are the trainer's (fastpo.cli)
    python bench/diagnose_groups.py --preset tiny --iterations 2 --quiet   # the sums only

Per kept batch it reports, for successful and failing trajectories apart: their count and trained tokens, and
for each estimator (GRPO, GRPO without the std division, GiGPO) the sum of the per-trajectory mean advantage
(what seq-mean-token-mean weighs) and of advantage x trained tokens (what token-mean weighs). Under token-mean a
group's zero-sum advantages stop summing to zero once its successes and failures differ in length.
Single process, no update (the model is not trained).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fastpo import algorithms, envs, update  # noqa: E402
from fastpo.cli import parse  # noqa: E402
from fastpo.cli_schema import describe  # noqa: E402
from fastpo.config import AlgorithmConfig, Config  # noqa: E402
from fastpo.engine.base import SamplingParams  # noqa: E402
from fastpo.engine.hf import HFEngine  # noqa: E402
from fastpo.env_mix import build_parts, resolve_mix  # noqa: E402
from fastpo.model import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from fastpo.preflight import validate  # noqa: E402
from fastpo.presets import PRESETS  # noqa: E402
from fastpo.rollout import RolloutPart, run_rollouts  # noqa: E402
from fastpo.trainer import RequestKind, request_seed  # noqa: E402

ESTIMATORS = {"grpo": {"adv_estimator": "grpo"}, "grpo-mean": {"adv_estimator": "grpo", "norm_adv_by_std": False},
              "gigpo": {"adv_estimator": "gigpo"}}


@dataclass
class DiagnoseArgs(Config):
    """A trainer config plus what to print."""

    iterations: int = 2
    """Training iterations' rollouts to inspect (>= 1; the model is not updated between them)."""
    quiet: bool = False
    """Print the sums only, not every kept trajectory."""


def main(argv: list[str] | None = None) -> int:
    args = parse(DiagnoseArgs, argv, prog="python bench/diagnose_groups.py", presets=PRESETS,
                 description=describe(__doc__.split("\n\n")[0]))
    cfg = validate(args, 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    envs.load_plugins(cfg.env.plugins)
    path = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    engine = HFEngine(load_policy(path).eval(), tok, seed=cfg.trainer.seed)
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.response_length, stop=tuple(r.stop))
    parts = build_parts(resolve_mix(cfg.env, "train"), range(cfg.env.env_groups), cfg.env.backend, r.enable_think,
                        cfg.env.action_sep)
    total: Counter = Counter()
    for it in range(args.iterations):
        seed_base = cfg.env.train_seed + it * cfg.env.env_groups
        jobs = []
        for p in parts:  # the trainer's env seeds and sampling seeds of iteration it + 1
            size = p.entry.group_size
            index = [first + j for first in p.first_index for j in range(size)]
            jobs.append(RolloutPart(p.env, p.spec, np.repeat([seed_base + g for g in p.groups], size),
                                    np.repeat(p.groups, size),
                                    [request_seed(cfg.trainer.seed, RequestKind.TRAIN, it + 1, i) for i in index],
                                    max_turns=p.entry.max_turns, max_actions_per_turn=p.entry.max_actions_per_turn,
                                    label=p.entry.label))
        batches = run_rollouts(jobs, engine, tok, sampling, r)
        trajs = [t for b in batches for t in b.trajectories]
        keep, _ = algorithms.filter_groups(torch.tensor([t.reward for t in trajs]),
                                           torch.tensor([t.group for t in trajs]), cfg.algorithm.rollout_filter_ratio,
                                           cfg.algorithm.rollout_filter_type)
        kept = keep.nonzero().squeeze(-1).tolist()
        adv = {}
        for name, over in ESTIMATORS.items():
            a, _, _ = update.advantages(trajs, kept, AlgorithmConfig(**{**vars(cfg.algorithm), **over}), False)
            adv[name] = {i: float(a[j][trajs[i].loss_mask].mean()) if trajs[i].loss_mask.any() else 0.0
                         for j, i in enumerate(kept)}
        success = np.mean([t.success for t in trajs])
        print(f"=== iteration {it + 1}: success {success:.3f}, kept {len(kept)} of {len(trajs)} trajectories")
        for g in sorted({t.group for t in trajs}):
            members = [i for i, t in enumerate(trajs) if t.group == g]
            rewards = [trajs[i].reward for i in members]
            mark = "kept" if members[0] in kept else "    "
            print(f"group {g:3d} {mark} success {sum(trajs[i].success for i in members)}/{len(members)} std "
                  f"{np.std(rewards, ddof=1) if len(rewards) > 1 else 0.0:.3f} rewards "
                  f"{' '.join(f'{x:+.1f}' for x in rewards)}")
            if args.quiet or members[0] not in kept:
                continue
            for i in members:
                t = trajs[i]
                answers = [m["content"].replace("<answer>", "").replace("</answer>", "") for m in t.messages
                           if m["role"] == "assistant"]
                print(f"    reward {t.reward:+.1f} success {int(t.success)} actions {t.num_actions} effective "
                      f"{t.num_effective_actions} tokens {int(t.loss_mask.sum())} | "
                      + " ".join(f"A_{n} {adv[n][i]:+.2f}" for n in adv) + " | " + " / ".join(answers))
        for i in kept:
            t = trajs[i]
            side = "success" if t.success else "failure"
            tokens = int(t.loss_mask.sum())
            total[f"{side}: trajectories"] += 1
            total[f"{side}: trained tokens"] += tokens
            for n in adv:
                total[f"{side}: sum A ({n}, per trajectory)"] += adv[n][i]
                total[f"{side}: sum A x tokens ({n})"] += adv[n][i] * tokens
    print(f"=== kept batches of {args.iterations} iteration(s)")
    for key in sorted(total):
        print(f"{key:45s} {total[key]:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
