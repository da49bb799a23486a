"""torchrun worker for tests/test_checkpoint.py: FSDP2-shard a tiny model, train, save or load, dump parameters.

torchrun --standalone --nproc_per_node=2 tests/dist_worker_checkpoint.py save RUN_DIR OUT.pt
torchrun --standalone --nproc_per_node=2 tests/dist_worker_checkpoint.py load RUN_DIR OUT.pt
"""

import os
import sys

import torch
from torch.distributed.fsdp import fully_shard

from fastpo import checkpoint
from fastpo import distributed as du


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # same init on every rank
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 / (1 + i))
    return model, optim, sched


def train(model, optim, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8)  # per-rank data from the per-rank RNG
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()


def full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def export_sharded_hf(model_dir: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    checkpoint.export_hf(model, AutoTokenizer.from_pretrained(model_dir), out_dir)


def main() -> None:
    mode, run_dir, out = sys.argv[1:4]
    info = du.init(backend="gloo")  # CPU ranks, pinned: cpu devices even where CUDA is visible
    du.seed_everything(0, info.rank)
    model, optim, sched = build()
    objects = {"model": model, "optim": optim, "sched": sched}
    if mode == "save":
        train(model, optim, sched, 2)
        checkpoint.save(run_dir, 2, objects, {"env_seed": 7}, config_hash="h")
        train(model, optim, sched, 2)  # the uninterrupted reference
        result = {"params": full_params(model)}
    else:
        torch.manual_seed(123 + info.rank)  # wrong RNG state: the checkpoint must restore it
        state = checkpoint.resume(run_dir, objects, config_hash="h")
        assert state == {"env_seed": 7}, state
        train(model, optim, sched, 2)
        result = {"params": full_params(model)}
        if len(sys.argv) > 4:  # export an FSDP2-sharded HF model: tiny model dir -> out dir
            export_sharded_hf(*sys.argv[4:6])
    if info.rank == 0:
        torch.save(result, out)
    du.barrier()
    du.shutdown()
    # FSDP2 on gloo aborts ~1 run in 10 at interpreter exit ("terminate called without an active exception",
    # torch 2.13 CPU, also without destroy_process_group); all work is done and flushed, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
