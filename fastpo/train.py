"""Training entry point (torchtitan-style thin main): parse config -> distributed init -> validate -> Trainer.

    python -m fastpo.train --preset tiny                                      # one process, CPU
    torchrun --standalone --nproc_per_node=2 -m fastpo.train --preset tiny    # 2 ranks (gloo on CPU, FSDP2)
    python -m fastpo.train --preset sokoban --trainer.run_dir runs/sok --trainer.resume auto
    python -m fastpo.train --help                                             # every config field

``--model.path tiny`` (the tiny preset) is the tiny CPU agent shipped in the package (``fastpo.tiny_agent``).
The run directory receives ``config.json`` (resolved config), ``metrics.jsonl``, ``checkpoints/step-XXXXXX``
and, at the end, the Hugging Face export ``hf/``, the training curves ``curves.png`` and ``report.txt`` (the
per-env validation success before vs after training, also printed; ``fastpo.report``). Exit status: 0 on
success, 1 when training stopped itself (logprob gap after a weight sync, too many non-finite steps; the
message says why), 2 for a bad config.
"""

from __future__ import annotations

import os
import sys

from . import distributed as du
from .config import ConfigError, parse_args, validate


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the exit status (see the module docstring)."""
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    info = du.init()
    try:
        try:
            validate(cfg, info.world_size)
        except ConfigError as err:
            if info.is_main:
                print(f"config error: {err}", file=sys.stderr)
            return 2
        from .trainer import Trainer, TrainingAborted

        trainer = Trainer(cfg, info)
        try:
            trainer.train()
        except TrainingAborted as err:
            if info.is_main:
                print(f"training stopped: {err}", file=sys.stderr, flush=True)
            trainer.close(export=False)
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
