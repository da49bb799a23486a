"""The library's messages go through the standard ``logging`` module, under the ``fastpo`` logger tree (each module
logs to ``logging.getLogger(__name__)``). A library user configures them the usual way (levels, handlers, format);
by default Python shows warnings and errors on stderr and drops the rest.

The command-line entry points call :func:`console`: messages alone on the line, as they always looked, INFO and
DEBUG on stdout and WARNING and above on stderr, drawn above a progress bar when one is active, on the main rank
only (a :class:`MainRankOnly` filter: torchrun's ``RANK`` 0, or no ``RANK``). ``--trainer.log_level`` sets the level.

Not logging: the per-iteration metric lines and the progress bar, which are the metrics console sink
(``fastpo.metrics.MetricsLogger``, ``trainer.log_console``), and a command's own result output (eval's table, the
report).
"""

from __future__ import annotations

import logging
import os
import sys

#: Accepted values of ``trainer.log_level`` (and :func:`console`'s `level`).
LEVELS = ("debug", "info", "warning", "error")
#: ``extra=ALL_RANKS`` on a logging call: shown on every rank (a rank-local event, e.g. on a node's own disk).
ALL_RANKS = {"all_ranks": True}


class MainRankOnly(logging.Filter):
    """Lets a record through on the main rank only (``RANK`` unset or 0: torchrun's rank, known before any process
    group exists). A record logged with ``extra={"all_ranks": True}`` passes on every rank (a rank-local problem)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "all_ranks", False)) or int(os.environ.get("RANK", "0") or 0) == 0


class _Console(logging.Handler):
    """The message alone, written to the ``sys.stdout`` / ``sys.stderr`` of the moment (so redirections and test
    capture see it): below WARNING to stdout, WARNING and above to stderr, above any progress bar being drawn."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from .progress import write

            write(self.format(record), sys.stderr if record.levelno >= logging.WARNING else sys.stdout)
        except Exception:  # a logging failure must not end the run (logging's own rule)
            self.handleError(record)


def console(level: str = "info") -> logging.Logger:
    """Send the ``fastpo`` loggers' messages to the console (see the module docstring) at `level` (one of
    :data:`LEVELS`); idempotent. Returns the ``fastpo`` logger."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {list(LEVELS)}, got {level!r}")
    logger = logging.getLogger("fastpo")
    if not any(isinstance(h, _Console) for h in logger.handlers):
        handler = _Console()
        handler.addFilter(MainRankOnly())
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # printed once, here, even when the application has a root handler
    return logger
