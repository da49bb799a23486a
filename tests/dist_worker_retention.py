"""torchrun worker for tests/test_checkpoint.py: checkpoint retention on node-local disks (one run folder per rank,
so the two ranks see two disks), where the disks disagree about which checkpoints are intact.

torchrun --standalone --nproc_per_node=2 tests/dist_worker_retention.py BASE OUT.json
"""

import json
import os
import sys
from pathlib import Path

import torch

from fastpo import checkpoint
from fastpo import distributed as du


def steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def main() -> None:
    base, out = Path(sys.argv[1]), sys.argv[2]
    info = du.init()
    run = base / f"disk{info.rank}" / "run"
    objs = {"m": torch.nn.Linear(2, 2)}
    for step in (1, 2, 3, 4):
        checkpoint.save(run, step, objs, {"step": step}, keep_last=None)
    before = steps(run)
    if info.rank == 1:  # disk 1: step 4 torn, step 2 gone; disk 0 holds both intact
        (run / "checkpoints" / "step-000004" / "trainer_state.json").write_text("{")
        (run / "checkpoints" / "step-000004" / "COMPLETE").touch()  # a new marker signature: checked, not trusted
        checkpoint._INTACT.clear()
        import shutil

        shutil.rmtree(run / "checkpoints" / "step-000002")
    du.barrier()
    checkpoint.save(run, 5, objs, {"step": 5}, keep_last=2)  # intact everywhere: 5, 3 (4 is torn on disk 1)
    after = steps(run)
    state = checkpoint.resume(run, {"m": torch.nn.Linear(2, 2)}, mode="auto")
    rows = [None] * 2
    torch.distributed.all_gather_object(rows, {"before": before, "after": after, "resumed": state})
    if info.rank == 0:
        Path(out).write_text(json.dumps(rows))
    du.barrier()
    du.shutdown()
    # gloo aborts now and then at interpreter exit ("terminate called without an active exception", torch 2.13 CPU;
    # seen here once in CI, 2026-12-07; dist_worker_checkpoint.py has the same exit): all work is done and flushed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
