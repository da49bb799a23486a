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
       iteration without a single trained token, a full disk, a collective that timed out or lost a rank);
       the ``training stopped:`` line says why; nothing is exported; or a plug-in env broke its protocol (one
       ``env error:`` line naming the env, the method and the seed).
    2  bad input, refused before any model loads: one ``config error:`` line per problem naming the field, the
       value and what is accepted (``config.validate``, ``fastpo.preflight``), or a run directory that may not
       be used.
Anything else (a traceback) is a bug.
"""

from __future__ import annotations

import os
import sys

from . import distributed as du
from .config import ConfigError, config_hash, parse_args, validate
from .storage import DiskFullError, claim_run_dir


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the exit status (see the module docstring)."""
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    timeout = cfg.trainer.collective_timeout_s
    info = du.init(timeout_s=timeout if 0 < timeout < float("inf") else None)  # validate reports a bad value
    try:
        try:
            validate(cfg, info.world_size)
            claim_run_dir(cfg.trainer.run_dir, cfg.trainer.resume, cfg.trainer.overwrite, config_hash(cfg))
        except ConfigError as err:
            if info.is_main:
                print(f"config error: {err}", file=sys.stderr)
            return 2
        from .envs.text import TextEnvError
        from .trainer import Trainer, TrainingAborted

        try:
            try:
                trainer = Trainer(cfg, info)
            except ConfigError as err:  # found once the tokenizer is loaded (a prompt that leaves no room for a turn)
                if info.is_main:
                    print(f"config error: {err}", file=sys.stderr)
                return 2
            try:
                trainer.train()
            except TrainingAborted as err:
                if info.is_main:
                    print(f"training stopped: {err}", file=sys.stderr, flush=True)
                trainer.close(export=False)
                return 1
            trainer.close()
        except (DiskFullError, RuntimeError) as err:
            message = str(err) if isinstance(err, DiskFullError) else du.collective_failure(err, timeout)
            if message is None:
                raise
            print(f"training stopped (rank {info.rank}): {message}", file=sys.stderr, flush=True)
            return 1
        except TextEnvError as err:  # a plug-in env broke its protocol: one line naming env, method and seed
            print(f"env error: {err}", file=sys.stderr, flush=True)
            return 1
        trainer.close()
        if info.is_main:
            from .report import write_report

            print(write_report(cfg.trainer.run_dir), flush=True)
        return 0
    finally:
        du.shutdown()


def cli() -> None:
    """Console entry (``python -m fastpo.train``, ``fastpo-train``): run :func:`main` and exit with its status."""
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torch 2.13 + gloo + FSDP2: about one process in ten aborts during interpreter teardown ("terminate
        # called without an active exception") after a clean shutdown, failing the whole torchrun. Everything is
        # written and the process group is destroyed by now, so leave without running the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    cli()
