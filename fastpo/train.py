"""Training entry point (torchtitan-style thin main): parse config -> distributed init -> validate -> Trainer.

    python -m fastpo.train --preset tiny                                      # one process, CPU
    torchrun --standalone --nproc_per_node=2 -m fastpo.train --preset tiny    # 2 ranks (gloo on CPU, FSDP2)
    python -m fastpo.train --preset sokoban --trainer.run_dir runs/sok --trainer.resume auto
    python -m fastpo.train --help                                             # every config field

``--model.path tiny`` (the tiny preset) is the tiny CPU agent shipped in the package (``fastpo.tiny_agent``).
The run directory receives ``config.json`` (resolved config), ``metrics.jsonl``, ``checkpoints/step-000150``
and, at the end, the Hugging Face export ``hf/``, the training curves ``curves.png`` and ``report.txt`` (the
per-env validation success before vs after training, also printed; ``fastpo.report``).

Exit status (also in ``--help``; docs/OPERATIONS.md):
    0  trained: every iteration ran, the model is exported.
    1  the run stopped itself (a logprob gap after a weight sync, too many non-finite steps in a row, an
       iteration without a single trained token, a full disk, a collective that timed out or lost a rank, told
       by the error's type and origin, never its words; another rank's failure); the ``training stopped:``
       line says why; nothing is exported; or a plug-in env failed mid-run (raised, broke its protocol or
       called ``sys.exit()``: one ``env error:`` line naming the env, the method and the seed).
    2  bad input, refused before any model loads: one ``config error:`` line per problem naming the field, the
       value and what is accepted (``fastpo.preflight.validate``), or a run directory that may not
       be used (it holds a run that would be lost, or another trainer holds its lock); nothing is deleted.
Anything else (a traceback) is a bug.

Start-up (``fastpo.startup.prepare_run``, called by ``Trainer.__init__``): every check first, then the run directory's
lock, then the first writes; a library user's ``Trainer(cfg)`` takes the same path.
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING

from . import log
from .config import Config, ConfigError
from .config_load import parse_args
from .preflight import validate

if TYPE_CHECKING:
    from . import distributed as du

# transformers, the trainer and its engines are imported only once the config has passed its checks: `--help`
# answers in under a second and a refused config in ~3 s (torch only) instead of after ~7 s of imports.

#: The longest collective timeout handed to the process group: 2**31 - 1 ms (24.9 days), the largest that fits the
#: signed 32-bit millisecond counts some timeout paths use. Far longer values overflow inside torch and gloo
#: (``timedelta`` raises OverflowError past ~8.6e13 s, gloo refuses ~8.6e13 s as a negative timeout and its socket
#: times out at once near 9.2e12 s); a longer wait is no different from a hang in practice.
MAX_COLLECTIVE_TIMEOUT_S = (2**31 - 1) / 1000


def process_group_timeout(value: float) -> float | None:
    """``trainer.collective_timeout_s`` as the process group takes it, before the config is validated: a value
    above :data:`MAX_COLLECTIVE_TIMEOUT_S` (inf included) is clamped to it; NaN, 0 and negatives give None (the
    default; ``preflight.validate`` then refuses the value with its range)."""
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if math.isnan(value) or value <= 0:
        return None
    return min(value, MAX_COLLECTIVE_TIMEOUT_S)


def _init(cfg: Config) -> tuple[du.DistInfo, float]:
    """The process group, with trainer.collective_timeout_s clamped to what it takes (said once on rank 0)."""
    from . import distributed as du

    timeout = process_group_timeout(cfg.trainer.collective_timeout_s)
    info = du.init(timeout_s=timeout)  # validate reports a bad value
    requested = cfg.trainer.collective_timeout_s
    if timeout is not None and math.isfinite(requested) and timeout < requested and info.is_main \
            and du.is_distributed():
        print(f"trainer.collective_timeout_s={requested:g} is above the longest timeout the "
              f"process group takes: using {timeout:g} s ({timeout / 86400:.1f} days)", file=sys.stderr, flush=True)
    return info, timeout if timeout is not None else du.DEFAULT_TIMEOUT_S


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the exit status (see the module docstring): build, train, close in one ``try``, and
    one place (:func:`_exit_status`) that maps what stopped it to a status."""
    info, trainer, timeout = None, None, None
    try:
        log.console()  # the library's messages on the console from the start (config errors included)
        cfg = parse_args(argv)
        log.console(cfg.trainer.log_level)
        validate(cfg, _env_int("WORLD_SIZE", 1))  # refused here, before the trainer's imports (it checks again)
        from .trainer import Trainer

        info, timeout = _init(cfg)
        trainer = Trainer(cfg, info)  # validates, checks, locks and claims the run directory, then builds
        trainer.train()
        trainer.close()  # the final checkpoint and the export, once (a full disk there is exit 1)
        if info.is_main:
            from .report import write_report

            print(write_report(cfg.trainer.run_dir), flush=True)
        return 0
    except Exception as err:
        return _exit_status(err, info, trainer, timeout)
    finally:
        if trainer is not None:
            trainer.unlock()  # closed or not (a failed run is not exported); a failed Trainer() released it itself
        if info is not None:
            from . import distributed as du

            du.shutdown()


def _env_int(name: str, default: int) -> int:
    """An integer set by the launcher (torchrun's WORLD_SIZE, LOCAL_RANK), or `default` when unset or not an integer
    (the process group's own set-up then reports it)."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _exit_status(err: Exception, info: du.DistInfo | None, trainer: object, timeout: float | None) -> int:
    """The status for what stopped ``main`` (its one line printed), or the exception raised again (a bug).
    ``timeout`` is the process group's (None before it exists, as ``info``)."""
    # before the process group exists (a config refused on every rank), each node's first rank speaks (torchrun's
    # LOCAL_RANK): once on one machine, and on every node's console when the nodes were started differently
    main_rank = info.is_main if info is not None else _env_int("LOCAL_RANK", 0) == 0
    if isinstance(err, ConfigError):  # bad input: before any model loads (the Trainer's late checks too)
        if main_rank:
            print(f"config error: {err}", file=sys.stderr)
        return 2
    from . import distributed as du
    from .envs.text import TextEnvError
    from .storage import DiskFullError, RankFailedError
    from .trainer import TrainingAborted

    if isinstance(err, TrainingAborted):
        if main_rank:
            print(f"training stopped: {err}", file=sys.stderr, flush=True)
        trainer.close(export=False)
        return 1
    if isinstance(err, TextEnvError):  # a plug-in env broke its protocol: one line naming env, method and seed
        print(f"env error: {err}", file=sys.stderr, flush=True)
        return 1
    if isinstance(err, (DiskFullError, RankFailedError, RuntimeError)) and info is not None:
        # a collective failure is told by the error's type and origin (du.collective_failure), not its words
        message = str(err) if isinstance(err, (DiskFullError, RankFailedError)) else du.collective_failure(err, timeout)
        if message is not None:
            print(f"training stopped (rank {info.rank}): {message}", file=sys.stderr, flush=True)
            return 1
    raise err


def cli() -> None:
    """Console entry (``python -m fastpo.train``, ``fastpo-train``): run :func:`main` and exit with its status."""
    status = main()
    if _env_int("WORLD_SIZE", 1) > 1:
        # torch 2.13 + gloo + FSDP2: about one process in ten aborts during interpreter teardown ("terminate
        # called without an active exception") after a clean shutdown, failing the whole torchrun. Everything is
        # written and the process group is destroyed by now, so leave without running the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    cli()
