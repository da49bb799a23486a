"""torchrun worker for tests/test_distributed.py: checks the collective helpers on 2 ranks, writes a JSON report.

torchrun --standalone --nproc_per_node=2 tests/dist_worker_distributed.py OUT_DIR
"""

import json
import logging
import os
import random
import sys

import torch

from fastpo import distributed as du
from fastpo import log


def main() -> None:
    out_dir = sys.argv[1]
    info = du.init(backend="gloo")  # CPU ranks, pinned: cpu devices even where CUDA is visible
    du.seed_everything(5, info.rank)
    mean = du.all_reduce_mean(torch.tensor([float(info.rank), 10.0 * info.rank]))
    obj = du.broadcast_object({"pid": os.getpid(), "rank": info.rank})
    log.console()
    logging.getLogger("fastpo.test").info("hello from rank 0 only")
    logging.getLogger("fastpo.test").warning("a warning from rank %d", info.rank, extra=log.ALL_RANKS)
    report = {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "device": str(info.device),
        "is_main": du.is_main(),
        "mean": mean.tolist(),
        "broadcast_rank": obj["rank"],
        "groups": list(du.shard_groups(8, info.world_size, info.rank)),
        "draw": random.random(),
    }
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(report, f)
    du.barrier()
    du.shutdown()


if __name__ == "__main__":
    main()
