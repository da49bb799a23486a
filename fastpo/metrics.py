"""Metrics: one rank-0 console line per iteration, metrics.jsonl, optional TensorBoard / W&B, phase timers,
memory, and the Echo Trap monitor (docs/SEMANTICS.md section 7).

    from fastpo.metrics import MetricsLogger, PhaseTimer, memory_metrics, EchoTrapMonitor
    logger = MetricsLogger(run_dir, rank, tensorboard=cfg.tensorboard, total_steps=cfg.iterations)
    timer, trap = PhaseTimer(), EchoTrapMonitor()
    for step in range(cfg.iterations):
        with timer("generate"): ...
        with timer("update"): ...
        metrics = {**rollout_metrics, **update_metrics, **timer.pop(), **memory_metrics()}
        for warning in trap.update(metrics):
            logger.warn(warning)
        logger.log(step, {**metrics, **trap.metrics()})
    logger.close()

Every rank constructs the logger; ranks other than 0 get null sinks, so call sites have no rank checks.
Console line (fixed order, only the fields present; see CONSOLE_FIELDS for the keys each one reads):

    step     12 | reward 0.512 | succ 0.406 | valid 0.970 | resp 123 | ent 0.812 | clip 0.031 | kl 1.2e-03 | ...

and after each validation a line of the success per validation env and its change since the first validation of
the run (``validation_line``; kept across a resume, read back from metrics.jsonl):

    val 40/150  FrozenLake 52.3% (+5.1)  Sokoban 30.1% (+2.0)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

#: (short name, metric keys tried in order, format) for the console line, in display order.
CONSOLE_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("rollout/reward", "rollout/reward_mean"), ".3f"),
    ("succ", ("rollout/success",), ".3f"),
    ("valid", ("rollout/action_is_valid",), ".3f"),
    ("resp", ("rollout/response_length",), ".0f"),
    ("ent", ("actor/entropy",), ".3f"),
    ("clip", ("actor/pg_clipfrac", "actor/clipfrac"), ".3f"),
    ("kl", ("actor/kl_loss", "actor/ppo_kl", "actor/kl", "actor/approx_kl"), ".1e"),
    ("gnorm", ("actor/grad_norm",), ".3g"),
    ("tok/s", ("perf/tokens_per_s",), "si"),
    ("env/s", ("perf/env_steps_per_s",), "si"),
    ("mem", ("memory/cuda_max_allocated_gb", "memory/rss_gb"), "gb"),
    ("time", ("timing/iteration",), "s"),
)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(value: float, spec: str) -> str:
    if not math.isfinite(value):
        return str(value)
    if spec == "si":
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.1f}{suffix}"
        return f"{value:.0f}"
    if spec == "gb":
        return f"{value:.2f}G"
    if spec == "s":
        return f"{value:.1f}s"
    return format(value, spec)


def console_line(step: int, metrics: dict[str, float]) -> str:
    """The one-line summary of an iteration: ``step N`` then the CONSOLE_FIELDS present in `metrics`."""
    parts = [f"step {step:6d}"]
    for short, keys, spec in CONSOLE_FIELDS:
        for key in keys:
            if key in metrics and metrics[key] is not None:
                parts.append(f"{short} {_fmt(float(metrics[key]), spec)}")
                break
    return " | ".join(parts)


def validation_successes(metrics: dict[str, Any]) -> dict[str, float]:
    """{env label: success in [0, 1]} from the ``val-env/<Env>/success`` keys of `metrics` that hold a finite
    number, in the order of `metrics`."""
    out = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "val-env" and parts[2] == "success" and _is_number(value):
            if math.isfinite(value):
                out[parts[1]] = float(value)
    return out


def validation_line(step: int, total: int | None, success: dict[str, float], start: dict[str, float]) -> str:
    """``val 40/150  FrozenLake 52.3% (+5.1)  Sokoban 30.1% (+2.0)``: each env's validation success (in %) at
    iteration `step` of `total` (None: unknown) and its change in points since `start` (the run's first validation;
    an env missing from `start` shows no change)."""
    parts = [f"val {step}/{total}" if total else f"val {step}"]
    for env, value in success.items():
        cell = f"{env} {100.0 * value:.1f}%"
        if env in start:
            cell += f" ({100.0 * (value - start[env]):+.1f})"
        parts.append(cell)
    return "  ".join(parts)


def first_validation(path: str | os.PathLike) -> dict[str, float]:
    """The per-env success of the first row of a metrics.jsonl file that has validation results ({} when none or
    no file); unreadable lines (a killed run's last line) are skipped."""
    path = Path(path)
    if not path.is_file():
        return {}
    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            found = validation_successes(row) if isinstance(row, dict) else {}
            if found:
                return found
    return {}


def _require(package: str, flag: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{flag}=True needs the `{package}` package, which is not installed: pip install "
                          f"'fastpo[{package}]' (or pip install {package}), or set {flag} false")


# ------------------------------------------------------------------------------------------- metric names
#: fastpo env labels whose RAGEN tag differs (the rest are RAGEN's tags already).
RAGEN_TAGS = {"Sokoban": "SimpleSokoban"}
#: fastpo key -> RAGEN / verl key, for keys renamed as a whole.
RAGEN_KEYS = {
    "actor/entropy": "actor/entropy_loss",
    "timing/generate": "timing_s/gen", "timing/score": "timing_s/old_log_prob", "timing/update": "timing_s/update",
    "timing/validate": "timing_s/testing", "timing/save": "timing_s/save_checkpoint", "timing/sync": "timing_s/sync",
    "timing/iteration": "timing_s/step",
    "timing/collapse": "timing_s/collapse_metrics", "timing/collapse_first_turn": "timing_s/collapse_first_turn_step",
    "timing/collapse_multi_turn": "timing_s/collapse_multi_turn_step",
}
#: fastpo key prefix -> RAGEN's, for families of keys (the collapse diagnostics, fastpo.diagnostics).
RAGEN_PREFIXES = {"collapse/first_turn/": "collapse_first_turn_sample/",
                  "collapse/multi_turn/": "collapse_trajectory_sample/"}
METRIC_NAME_SCHEMES = ("fastpo", "ragen")
_ENV_KEY = re.compile(r"^(env|val-env)/([^/]+)/(.+)$")


def ragen_metric_name(key: str) -> str:
    """RAGEN's name of a fastpo metric key: ``env/<Label>/k`` -> ``train/<Tag>/k``, ``val-env/<Label>/k`` ->
    ``val-env/<Tag>/k`` (Tag = RAGEN_TAGS.get(Label, Label)), the RAGEN_KEYS renames and RAGEN_PREFIXES; every other
    key (rollout/*, actor/pg_*, critic/*, ...) is already RAGEN's or verl's and stays."""
    m = _ENV_KEY.match(key)
    if m:
        prefix, label, rest = m.groups()
        return f"{'train' if prefix == 'env' else prefix}/{RAGEN_TAGS.get(label, label)}/{rest}"
    for ours, theirs in RAGEN_PREFIXES.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return RAGEN_KEYS.get(key, key)


def rename_metrics(metrics: dict[str, Any], scheme: str) -> dict[str, Any]:
    """``metrics`` with keys in `scheme` ("fastpo": unchanged, "ragen": :func:`ragen_metric_name`)."""
    if scheme not in METRIC_NAME_SCHEMES:
        raise ValueError(f"trainer.metric_names must be one of {METRIC_NAME_SCHEMES}, got {scheme!r}")
    if scheme == "fastpo":
        return dict(metrics)
    return {ragen_metric_name(k): v for k, v in metrics.items()}


# ------------------------------------------------------------------------------------------- data metrics
def _stats(prefix: str, x: Any) -> dict[str, float]:
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    if not x.size:
        return {}
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def data_metrics(scores: Any, masks: list, advantages: list, returns: list | None = None,
                 values: list | None = None, lengths: Any = None, max_len: int | None = None) -> dict[str, float]:
    """verl's ``compute_data_metrics`` over the trained batch (the kept trajectories).

    scores [B] (trajectory returns), masks / advantages / returns / values: one array [T_i] per trajectory (bool
    trained-token mask; fp32 token values), lengths [B] token counts, max_len the context cap. Keys:
    ``critic/score/{mean,max,min}`` and ``critic/rewards/*`` (trajectory returns: fastpo has no in-reward KL, so
    they are equal), ``critic/advantages/*``, ``critic/returns/*`` (returns None: the advantages, as verl's
    outcome estimators return them) and with values ``critic/values/*`` and ``critic/vf_explained_var`` =
    1 - var(returns - values) / (var(returns) + 1e-5) (unbiased var), all over trained tokens;
    ``response_length/*`` (tokens from the first trained token to the end), ``response_length/clip_ratio``
    (share of trajectories whose length reached max_len), ``prompt_length/*`` (tokens before the first trained
    token)."""
    import numpy as np

    def flat(arrays: list) -> np.ndarray:
        picked = [np.asarray(a, dtype=np.float64)[np.asarray(m, dtype=bool)] for a, m in zip(arrays, masks,
                                                                                           strict=True)]
        return np.concatenate(picked) if picked else np.zeros(0)

    out = {**_stats("critic/score", scores), **_stats("critic/rewards", scores)}
    adv = flat(advantages)
    ret = flat(returns) if returns is not None else adv
    out.update(_stats("critic/advantages", adv))
    out.update(_stats("critic/returns", ret))
    if values is not None:
        val = flat(values)
        out.update(_stats("critic/values", val))
        if ret.size > 1:
            out["critic/vf_explained_var"] = float(1.0 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + 1e-5))
    if lengths is not None:
        first = np.array([int(np.argmax(np.asarray(m, dtype=bool))) if np.any(m) else len(m) for m in masks])
        lengths = np.asarray(lengths, dtype=np.int64)
        out.update(_stats("response_length", lengths - first))
        out.update(_stats("prompt_length", first))
        if max_len is not None and lengths.size:
            out["response_length/clip_ratio"] = float(np.mean(lengths >= max_len))
    return out


# ------------------------------------------------------------------------------------------- generations
GENERATION_FIELDS = ("step", "env", "group", "seed", "prompt", "response", "reward", "success")
#: Columns of RAGEN's group reward-variance table (``trainer.log_group_rv_table``).
GROUP_RV_FIELDS = ("step", "group_id", "reward_std", "selected")
GROUP_RV_FILE = "group_rv.jsonl"


def generation_record(tokenizer: Any, label: str, traj: Any) -> dict[str, Any]:
    """One validation sample for the generations table (GENERATION_FIELDS but step) from a
    ``fastpo.rollout.Trajectory``: the prompt (the tokens before the first trained one) and the response (the rest:
    every turn and observation), decoded with special tokens."""
    mask = traj.loss_mask
    first = int(mask.argmax()) if mask.any() else len(traj.input_ids)
    return {"env": label, "group": int(traj.group), "seed": int(traj.seed),
            "prompt": tokenizer.decode(traj.input_ids[:first]), "response": tokenizer.decode(traj.input_ids[first:]),
            "reward": float(traj.reward), "success": bool(traj.success)}


def pick_generations(records: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """RAGEN's sample of a validation: records sorted (by prompt, then the other fields), shuffled with
    ``numpy.random.RandomState(42)``, the first n. The same fixed-seed prompts come back each validation."""
    import numpy as np

    if n <= 0:
        return []
    ordered = sorted(records, key=lambda r: tuple(str(r.get(f, "")) for f in ("prompt", *GENERATION_FIELDS)))
    order = np.arange(len(ordered))
    np.random.RandomState(42).shuffle(order)
    return [ordered[i] for i in order[:n]]


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(GENERATION_FIELDS) + " |\n|" + "---|" * len(GENERATION_FIELDS) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(f, "")) for f in GENERATION_FIELDS) + " |\n" for r in rows)


class _Jsonl:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a")  # noqa: SIM115 (kept open for the run, closed in close())

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _drop_rows_after(path: Path, step: int) -> int:
    """Rewrite the JSON-lines file `path` (if any) without its rows of steps after `step` and its unparsable lines
    (temp file + rename); returns how many were dropped."""
    kept, dropped = [], 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            keep = int(json.loads(line)["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Per-iteration metrics to console, ``<run_dir>/metrics.jsonl`` and optionally TensorBoard / W&B.

    Only rank 0 writes; on other ranks every method is a no-op (null sinks), so callers never branch on rank.

    Args:
        run_dir: run directory (metrics.jsonl and the TensorBoard ``tb/`` folder go here).
        rank: this process's global rank.
        console: print one line per :meth:`log`, a :func:`validation_line` for each log that holds validation
            results, and, when ``total_steps`` is given, a progress bar with the run's ETA on stderr
            (``fastpo.progress``: a terminal, or FASTPO_PROGRESS=1). A resumed run calls :meth:`start_progress`
            with its step, so the bar continues the count and the change is measured from the run's start.
        jsonl: append one JSON object per :meth:`log` to metrics.jsonl, flushed each time. Non-finite values
            (nan, inf) are written as null and counted in :attr:`non_finite` (key -> count).
        tensorboard / wandb: also log there; ImportError naming the package when it is not installed.
        project / run_name / config: W&B project, run name (default: the run directory's name) and config dict
            (the full run config).
        wandb_resume: continue the W&B run whose id is stored in ``<run_dir>/wandb_run_id`` (a resumed
            training run); otherwise a new id is drawn and stored there.
        metric_names: "fastpo" or "ragen" (:func:`rename_metrics`), applied to every sink but the console line.
        stream: where console lines go (default sys.stdout).
        progress_stream: where the bar goes (default sys.stderr).
    """

    WANDB_ID_FILE = "wandb_run_id"

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int,
        console: bool = True,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        project: str | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        total_steps: int | None = None,
        stream: TextIO | None = None,
        wandb_resume: bool = False,
        metric_names: str = "fastpo",
        progress_stream: TextIO | None = None,
    ):
        rename_metrics({}, metric_names)  # rejects an unknown scheme on every rank
        self.metric_names = metric_names
        self.active = rank == 0
        self.run_dir = Path(run_dir)
        self.non_finite: Counter[str] = Counter()
        self.stream = stream if stream is not None else sys.stdout
        self.console = console and self.active
        self._jsonl = _Jsonl(self.run_dir / "metrics.jsonl") if jsonl and self.active else None
        self._generations_jsonl = jsonl
        self._group_rv: list[list[Any]] = []  # the W&B table's rows so far (RAGEN re-logs the whole table each time)
        self._tb = None
        self._wandb_module = None
        self._wandb = None
        self._bar = None
        if tensorboard:
            _require("tensorboard", "trainer.log_tensorboard")
            if self.active:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if wandb:
            _require("wandb", "trainer.log_wandb")
            if self.active:
                import wandb as wandb_module

                self._wandb_module = wandb_module
                self._wandb = wandb_module.init(project=project, name=run_name or self.run_dir.name, config=config,
                                                dir=str(self.run_dir), id=self._wandb_id(wandb_resume),
                                                resume="allow")
        self.total_steps = total_steps
        self.progress_stream = progress_stream
        #: env label -> success at the run's first validation (the reference of the validation line's change)
        self.val_start: dict[str, float] = {}

    def start_progress(self, step: int = 0) -> None:
        """Open the progress bar at iteration `step` of ``total_steps`` (a resumed run's step) and, when resuming,
        read the run's first validation back from metrics.jsonl. :meth:`log` opens it at 0 if never called."""
        if not self.console:
            return
        if self._bar is not None:
            self._bar.close()
        if self.total_steps:
            from .progress import progress_bar

            self._bar = progress_bar(self.total_steps, initial=step, desc="train", unit="it",
                                     stream=self.progress_stream)
        if step > 0 and not self.val_start:
            self.val_start = first_validation(self.run_dir / "metrics.jsonl")

    def _wandb_id(self, resume: bool) -> str:
        """The W&B run id: the stored one when resuming (a new one if none is stored), else a fresh one, stored."""
        path = self.run_dir / self.WANDB_ID_FILE
        if resume and path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = secrets.token_hex(4)  # W&B ids are short [a-z0-9] strings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
        return run_id

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A validation's sampled generations (dicts with :data:`GENERATION_FIELDS`): appended to
        ``<run_dir>/generations.jsonl`` (one line per sample), a TensorBoard text table and the W&B table
        ``val/generations`` (RAGEN's name)."""
        if not self.active or not rows:
            return
        rows = [{**r, "step": step} for r in rows]
        if self._generations_jsonl:
            with open(self.run_dir / "generations.jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps({k: r.get(k) for k in GENERATION_FIELDS}) + "\n")
        if self._tb is not None:
            self._tb.add_text("val/generations", _markdown_table(rows), step)
            self._tb.flush()
        if self._wandb is not None:
            table = self._wandb_module.Table(columns=list(GENERATION_FIELDS),
                                             data=[[r.get(k) for k in GENERATION_FIELDS] for r in rows])
            self._wandb.log({"val/generations": table}, step=step)

    def log_group_rv(self, step: int, rows: list[dict[str, Any]]) -> None:
        """RAGEN's ``log_group_rv_table``: each group's reward std this iteration and whether the filter kept it
        (dicts with the :data:`GROUP_RV_FIELDS` but step), appended to ``<run_dir>/group_rv.jsonl`` (one line per
        group) and, with W&B, logged as the table ``rollout/group_rv_table`` holding every row since this process
        started (RAGEN's name; W&B replaces a table, so it is logged whole)."""
        if not self.active or not rows:
            return
        table = [[step, int(r["group_id"]), float(r["reward_std"]), bool(r["selected"])] for r in rows]
        if self._generations_jsonl:
            with open(self.run_dir / GROUP_RV_FILE, "a") as f:
                for row in table:
                    f.write(json.dumps(dict(zip(GROUP_RV_FIELDS, row, strict=True))) + "\n")
        if self._wandb is not None:
            self._group_rv += table
            self._wandb.log({"rollout/group_rv_table": self._wandb_module.Table(
                columns=list(GROUP_RV_FIELDS), data=[list(r) for r in self._group_rv])}, step=step)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            from .progress import write

            write(line, self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record iteration `step`'s scalar metrics (python numbers or 0-dim tensors)."""
        if not self.active:
            return
        clean: dict[str, float | None] = {}
        for key, value in metrics.items():
            value = float(value.item() if hasattr(value, "item") else value)
            if math.isfinite(value):
                clean[key] = value
            else:
                clean[key] = None
                self.non_finite[key] += 1
        named = rename_metrics(clean, self.metric_names)
        if self._jsonl is not None:
            self._jsonl.write({"step": step, "time": time.time(), **named})
        finite = {k: v for k, v in named.items() if v is not None}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(finite, step=step)
        if self.console:
            if self._bar is None and self.total_steps:
                self.start_progress(0)
            line = console_line(step, clean)
            missing = [k for k, v in clean.items() if v is None]
            if missing:
                line += f" | non-finite: {','.join(missing)}"
            self._print(line)
            success = validation_successes(clean)
            if success:
                for env, value in success.items():  # the first validation of each env is its reference
                    self.val_start.setdefault(env, value)
                self._print(validation_line(step, self.total_steps, success, self.val_start))
        if self._bar is not None and step > self._bar.n:  # the bar counts iterations: step 0 is validation only
            self._bar.update(step - self._bar.n)

    def truncate_after(self, step: int) -> int:
        """Drop the metrics.jsonl rows of steps after `step` (a resumed run replays them; -1 drops every row), so
        the file holds each step once; the same for group_rv.jsonl. Rewritten atomically (temp file + rename); an
        unparsable line (the torn last line of a killed run) is dropped too. Returns the number of metrics rows
        dropped (0 on other ranks)."""
        if self._jsonl is None:
            return 0
        path = self._jsonl.path
        self._jsonl.close()
        dropped = _drop_rows_after(path, step)
        _drop_rows_after(self.run_dir / GROUP_RV_FILE, step)
        self._jsonl = _Jsonl(path)
        return dropped

    def warn(self, message: str) -> None:
        """A warning line on rank 0's console (e.g. from EchoTrapMonitor)."""
        if self.console:
            self._print(f"WARNING: {message}")

    def close(self) -> None:
        for sink in (self._jsonl, self._tb, self._bar):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = self._bar = None


class PhaseTimer:
    """Wall-clock seconds per phase, summed over repeated entries until :meth:`pop`.

    >>> timer = PhaseTimer()
    >>> with timer("generate"):
    ...     pass
    >>> sorted(timer.pop())
    ['timing/generate']

    Args:
        synchronize: call ``torch.cuda.synchronize()`` at each phase boundary so GPU work is attributed
            to the phase that launched it (only when CUDA is initialised).
    """

    def __init__(self, synchronize: bool = False, prefix: str = "timing/"):
        self.synchronize = synchronize
        self.prefix = prefix
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.synchronize:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``{"timing/<phase>": seconds}`` accumulated so far."""
        return {f"{self.prefix}{phase}": s for phase, s in self.seconds.items()}

    def pop(self) -> dict[str, float]:
        """:meth:`metrics`, then reset for the next iteration."""
        out = self.metrics()
        self.seconds = {}
        return out


_NVML: dict[str, Any] = {}


def _nvml_handle(device: Any) -> Any | None:
    """pynvml handle of the CUDA `device` (a torch.device of type cuda), or None when nvidia-ml-py is not installed,
    there is no GPU / driver, or NVML cannot tell which GPU it is. The device is found by its UUID: CUDA's index
    is not NVML's under CUDA_VISIBLE_DEVICES, so the index is used only when that variable is unset."""
    if "module" not in _NVML:
        _NVML["module"] = None
        if importlib.util.find_spec("pynvml") is not None:  # optional: GPU util is reported only when present
            import pynvml

            try:
                pynvml.nvmlInit()
                _NVML["module"] = pynvml
            except pynvml.NVMLError:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without a GPU
                pass
    pynvml = _NVML["module"]
    if pynvml is None:
        return None
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    try:
        if uuid is not None:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:  # a MIG slice, or a UUID NVML does not list
        pass
    return None


def _rss_gb() -> tuple[str, float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return "memory/rss_gb", int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return "memory/peak_rss_gb", peak / (2**30 if sys.platform == "darwin" else 2**20)


def memory_metrics(device: Any = None) -> dict[str, float]:
    """Host RSS (GiB); on CUDA also max allocated / reserved (GiB) since the last reset; with nvidia-ml-py
    installed and a GPU present, GPU utilisation (%) and device memory used (GiB). Absent keys mean "not
    available here", never an error."""
    key, rss = _rss_gb()
    out = {key: rss}
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type == "cuda":
            out["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
            out["memory/cuda_max_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / 2**30
            handle = _nvml_handle(dev)
            if handle is not None:
                pynvml = _NVML["module"]
                try:  # NotSupported on some devices (MIG slices, some virtual GPUs): then the keys are absent
                    out["gpu/util_percent"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    out["gpu/memory_used_gb"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
                except pynvml.NVMLError:
                    pass
    return out


@dataclass
class EchoTrapThresholds:
    """When :class:`EchoTrapMonitor` warns (docs/SEMANTICS.md section 7: the early signs of an Echo Trap)."""

    #: warn when in-group reward std (``rollout/in_group_std``) falls below this
    std_floor: float = 0.05
    #: warn when entropy falls below its running median by more than this fraction (a drop: the early signal)
    entropy_rel_change: float = 0.5
    #: warn when entropy rises above this multiple of its running median (a jump); None: 1 + entropy_rel_change
    entropy_jump_factor: float | None = None
    #: warn when a grad norm exceeds this multiple of its running median
    grad_spike_k: float = 5.0
    #: iterations in the running median
    window: int = 10
    #: iterations of history needed before entropy / grad-norm comparisons start
    min_history: int = 3


class EchoTrapMonitor:
    """Tracks in-group reward std, entropy and grad norms over iterations and warns on collapse signals.

    ``update(metrics)`` reads ``rollout/in_group_std``, ``actor/entropy``, ``actor/grad_norm`` and
    ``critic/grad_norm`` (whichever are present and finite), compares against the running median of the
    previous ``window`` iterations, returns the warnings of this iteration and counts them in
    :attr:`counts` (signal -> number of warnings); :meth:`metrics` returns the counts as ``echo_trap/*``.
    """

    STD_KEY = "rollout/in_group_std"
    ENTROPY_KEY = "actor/entropy"
    GRAD_KEYS = ("actor/grad_norm", "critic/grad_norm")

    def __init__(self, thresholds: EchoTrapThresholds | None = None):
        self.t = thresholds or EchoTrapThresholds()
        if self.t.window < 1 or self.t.min_history < 1 or self.t.min_history > self.t.window:
            raise ValueError(
                f"need 1 <= min_history <= window, got min_history={self.t.min_history}, window={self.t.window}"
            )
        self.history: dict[str, deque[float]] = {}
        self.counts: Counter[str] = Counter({"in_group_std": 0, "entropy": 0, "grad_norm": 0})
        self.iteration = 0

    def _median(self, key: str) -> float | None:
        past = self.history.get(key)
        if past is None or len(past) < self.t.min_history:
            return None
        return statistics.median(past)

    def _push(self, key: str, value: float) -> None:
        self.history.setdefault(key, deque(maxlen=self.t.window)).append(value)

    def update(self, metrics: dict[str, float]) -> list[str]:
        """Check this iteration's metrics; returns the warnings (empty when nothing looks wrong)."""
        warnings: list[str] = []
        it = self.iteration
        self.iteration += 1

        def value(key: str) -> float | None:
            v = metrics.get(key)
            if v is None:
                return None
            v = float(v.item() if hasattr(v, "item") else v)
            return v if math.isfinite(v) else None

        std = value(self.STD_KEY)
        if std is not None and std < self.t.std_floor:
            self.counts["in_group_std"] += 1
            warnings.append(
                f"echo trap (iteration {it}): in-group reward std {std:.4g} < floor {self.t.std_floor:g}; "
                f"groups no longer separate good from bad responses"
            )

        ent = value(self.ENTROPY_KEY)
        if ent is not None:
            med = self._median(self.ENTROPY_KEY)
            if med is not None and med > 0:
                rel = (ent - med) / med
                jump = self.t.entropy_jump_factor if self.t.entropy_jump_factor is not None else (
                    1.0 + self.t.entropy_rel_change)
                if -rel > self.t.entropy_rel_change or ent > jump * med:
                    self.counts["entropy"] += 1
                    threshold = (f"{-self.t.entropy_rel_change:+.0%}" if rel < 0 else f"{jump:g}x")
                    warnings.append(
                        f"echo trap (iteration {it}): entropy {'dropped' if rel < 0 else 'jumped'} "
                        f"to {ent:.4g} ({rel:+.0%} vs running median {med:.4g}, threshold {threshold})"
                    )
            self._push(self.ENTROPY_KEY, ent)

        for key in self.GRAD_KEYS:
            g = value(key)
            if g is None:
                continue
            med = self._median(key)
            if med is not None and med > 0 and g > self.t.grad_spike_k * med:
                self.counts["grad_norm"] += 1
                warnings.append(
                    f"echo trap (iteration {it}): {key} {g:.4g} is {g / med:.1f}x its running median "
                    f"{med:.4g} (threshold {self.t.grad_spike_k:g}x)"
                )
            self._push(key, g)
        return warnings

    def metrics(self) -> dict[str, float]:
        """Cumulative warning counts: ``echo_trap/in_group_std``, ``echo_trap/entropy``, ``echo_trap/grad_norm``."""
        return {f"echo_trap/{k}": float(v) for k, v in self.counts.items()}
