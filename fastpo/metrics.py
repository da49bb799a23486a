"""Metrics: one rank-0 console line per iteration, metrics.jsonl, optional TensorBoard / W&B, phase timers,
memory, and the Echo Trap monitor (shared/design/SPEC.md section 7).

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
        raise ImportError(f"{flag}=True needs the `{package}` package: pip install {package}")


class _Jsonl:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")  # noqa: SIM115 (kept open for the run, closed in close())

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


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
        project / run_name / config: W&B project, run name and config dict.
        stream: where console lines go (default sys.stdout).
        progress_stream: where the bar goes (default sys.stderr).
    """

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
        progress_stream: TextIO | None = None,
    ):
        self.active = rank == 0
        self.run_dir = Path(run_dir)
        self.non_finite: Counter[str] = Counter()
        self.stream = stream if stream is not None else sys.stdout
        self.console = console and self.active
        self._jsonl = _Jsonl(self.run_dir / "metrics.jsonl") if jsonl and self.active else None
        self._tb = None
        self._wandb = None
        self._bar = None
        if tensorboard:
            _require("tensorboard", "tensorboard")
            if self.active:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if wandb:
            _require("wandb", "wandb")
            if self.active:
                import wandb as wandb_module

                self._wandb = wandb_module.init(project=project, name=run_name, config=config, dir=str(self.run_dir))
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
        if self._jsonl is not None:
            self._jsonl.write({"step": step, "time": time.time(), **clean})
        finite = {k: v for k, v in clean.items() if v is not None}
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


def _nvml_handle(index: int) -> Any | None:
    """pynvml device handle, or None when nvidia-ml-py is not installed or there is no GPU / driver."""
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
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
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
            handle = _nvml_handle(dev.index or 0)
            if handle is not None:
                pynvml = _NVML["module"]
                out["gpu/util_percent"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                out["gpu/memory_used_gb"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    return out


@dataclass
class EchoTrapThresholds:
    """When :class:`EchoTrapMonitor` warns (SPEC section 7: early signs of collapse into repetitive output)."""

    #: warn when in-group reward std (``rollout/in_group_std``) falls below this
    std_floor: float = 0.05
    #: warn when entropy differs from its running median by more than this fraction (drop or jump)
    entropy_rel_change: float = 0.5
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
                if abs(rel) > self.t.entropy_rel_change:
                    self.counts["entropy"] += 1
                    warnings.append(
                        f"echo trap (iteration {it}): entropy {'dropped' if rel < 0 else 'jumped'} "
                        f"to {ent:.4g} ({rel:+.0%} vs running median {med:.4g}, "
                        f"threshold {self.t.entropy_rel_change:.0%})"
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
