"""Progress bars with an ETA for training, SFT and evaluation (tqdm), shown where a person is watching.

    from fastpo.progress import progress_bar
    bar = progress_bar(total=150, initial=resumed_step, desc="train", unit="it")
    for step in range(resumed_step, 150):
        ...
        bar.update(1)
    bar.close()

Bars go to stderr, from rank 0 only, so stdout keeps the plain log lines (print them with :func:`write`, which
lifts the bar out of the way). Whether a bar is drawn is the environment variable ``FASTPO_PROGRESS``:
``auto`` (default: when stderr is a terminal, so CI logs and ``| tee`` captures get no carriage-return noise),
``1`` (always, e.g. to watch a job through ``tail -f``), ``0`` (never). A disabled bar is tqdm's no-op bar: callers
never branch on it.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from tqdm import tqdm

#: environment variable: auto | 1 | 0 (see the module docstring)
ENV_VAR = "FASTPO_PROGRESS"
_ON, _OFF = {"1", "true", "on", "always"}, {"0", "false", "off", "never"}


def progress_enabled(stream: TextIO | None = None, rank: int | None = None) -> bool:
    """Whether to draw a bar on ``stream`` (default stderr) from this process: never on a rank other than 0
    (``rank`` default: the RANK environment variable torchrun sets), else as ``FASTPO_PROGRESS`` says."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return False
    value = os.environ.get(ENV_VAR, "auto").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value != "auto":
        raise ValueError(f"{ENV_VAR}={value!r}: expected auto, 1 or 0")
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def start_position(step: int, total: int) -> int:
    """Where the bar of a run resumed after iteration ``step`` of ``total`` starts: the iterations already done
    (clamped to 0..total), so the count and the ETA cover the whole run, not this process's part of it."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return min(max(int(step), 0), int(total))


def progress_bar(total: int, initial: int = 0, desc: str = "", unit: str = "it", stream: TextIO | None = None,
                 enabled: bool | None = None, smoothing: float = 0.0, **kwargs: Any) -> tqdm:
    """A tqdm bar over ``total`` units starting at ``initial`` (:func:`start_position`), on ``stream`` (default
    stderr); ``enabled`` None = :func:`progress_enabled`. ``smoothing`` 0 (tqdm's default is 0.3): the ETA uses the
    average rate since the start, so that periodic slow steps (validation, checkpoints) are spread over the run
    instead of swinging it."""
    stream = stream if stream is not None else sys.stderr
    if enabled is None:
        enabled = progress_enabled(stream)
    return tqdm(total=total, initial=start_position(initial, total), desc=desc or None, unit=unit, file=stream,
                disable=not enabled, dynamic_ncols=True, leave=True, smoothing=smoothing, **kwargs)


def write(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` on ``stream`` (default stdout) above any bar being drawn, flushed. The line and its newline go
    out in one write: ranks sharing one stderr pipe (torchrun) would otherwise interleave between the two."""
    tqdm.write(line + "\n", file=stream if stream is not None else sys.stdout, end="")
    (stream if stream is not None else sys.stdout).flush()
