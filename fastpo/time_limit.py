"""A call given at most a number of seconds: the env constructions and resets of the checks before any model loads
(``fastpo.preflight``, ``fastpo.env_mix``, ``fastpo.eval``), so a plug-in env that blocks ends in one config error
naming the env and the method instead of a hang.

    call_with_time_limit(fn, 60.0, "env 'guess': reset (seed 5)")       # fn(), or PreflightTimeout after 60 s
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from .config import ConfigError


class PreflightTimeout(ConfigError):
    """A call into an env during the checks did not return within ``env.preflight_timeout_s``."""


def call_with_time_limit(fn: Callable[[], Any], limit_s: float | None, what: str) -> Any:
    """``fn()``, given at most ``limit_s`` seconds (None or inf: no limit); ``what`` names the call in the error, e.g.
    ``"env 'guess': reset (seed 5)"``. Exceptions of ``fn`` (SystemExit included) are raised here.

    Python cannot stop a function from outside, so ``fn`` runs in a daemon thread that the caller stops waiting for:
    :class:`PreflightTimeout` says which call hung and the command then exits (status 2). Limitations: the stuck call
    goes on in the background until the process ends (do not reuse the object it works on); a call that never
    releases the GIL (a C extension's busy loop) cannot be waited out; and ``fn`` runs outside the main thread, so
    an env that installs signal handlers there fails."""
    if limit_s is None or not math.isfinite(limit_s):
        return fn()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # handed over to the caller's thread, which raises it
            outcome["error"] = err

    thread = threading.Thread(target=run, name=f"fastpo-preflight {what}", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise PreflightTimeout(f"{what} did not return within env.preflight_timeout_s ({limit_s:g} s); fix the env, "
                               f"or raise env.preflight_timeout_s if it needs longer (inf = no limit)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
