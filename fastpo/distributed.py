"""One code path for a single process and for torchrun: process group, rank helpers, seeding, RNG state.

    python -m fastpo.train ...                                   # 1 process: no process group at all
    torchrun --standalone --nproc_per_node=2 -m fastpo.train ... # gloo on CPU, nccl on CUDA
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=host:29500 -m fastpo.train ...

    from fastpo import distributed as dist_utils
    info = dist_utils.init()                # DistInfo(rank, world_size, local_rank, device)
    dist_utils.seed_everything(cfg.seed, info.rank)
    groups = dist_utils.shard_groups(cfg.env_groups, info.world_size, info.rank)
    logging.getLogger("fastpo").info(f"{info.world_size} ranks")  # shown on rank 0 (fastpo.log)
    ...
    dist_utils.shutdown()

Single process (no RANK/WORLD_SIZE in the environment): no process group is created. Every helper here
works without one (barrier is a no-op, all_reduce_mean returns a copy, broadcast_object returns its
argument), torch.distributed.checkpoint runs in its no-process-group mode, and nothing binds a port. The
one thing that needs a process group is FSDP2 ``fully_shard``: the trainer only shards when
``is_distributed()``.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

#: Per-rank seed offset: rank r seeds torch/numpy/random with ``seed + r * RANK_SEED_STRIDE`` (mod 2**32).
#: A large prime so that runs with adjacent seeds do not share streams between ranks.
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, number of processes, rank on this node, and its torch device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_distributed() -> bool:
    """True when a torch.distributed process group is initialised (torchrun), False for a plain process."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


#: Collective timeout when :func:`init` is not given one (torch's own default is 30 minutes for gloo).
DEFAULT_TIMEOUT_S = 300.0


def init(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the process group when launched by torchrun, else stay a plain single process.

    Args:
        backend: "gloo" or "nccl"; default nccl when CUDA is available, gloo otherwise. Ignored for a
            single process. Calling init again returns the same DistInfo.
        timeout_s: how long a rank waits in a collective (barrier, all-gather, ...) for the others before it
            raises (default :data:`DEFAULT_TIMEOUT_S`): a stalled or dead rank then fails the job instead of
            hanging it. Under nccl torch enforces it through its watchdog (async error handling on by default).

    Returns:
        DistInfo; ``device`` is ``cuda:<local_rank>`` (made current) under nccl, cpu under gloo (a CPU-rank run on a
        CUDA machine, e.g. 2 ranks on 1 GPU, never touches a GPU); a single process gets cuda:0 when CUDA is
        available, else cpu.
    """
    if _launched_by_torchrun():
        local_rank = int(os.environ["LOCAL_RANK"])
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        # the device follows the backend, as fastpo.fsdp's mesh does; a group that exists already decides itself
        on_cuda = "nccl" in str(dist.get_backend() if is_distributed() else backend)
        if on_cuda:
            torch.cuda.set_device(local_rank)
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be > 0 and finite, got {timeout_s}")
        if not is_distributed():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    else:
        local_rank, on_cuda = 0, torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    return DistInfo(rank=get_rank(), world_size=get_world_size(), local_rank=local_rank, device=device)


def shutdown() -> None:
    """Destroy the process group if there is one (safe to call for a single process or twice)."""
    if is_distributed():
        dist.destroy_process_group()


#: torch.distributed's own folder: gloo's collective errors are plain RuntimeErrors raised from its functions there.
_TORCH_DISTRIBUTED_DIR = os.path.dirname(os.path.abspath(dist.__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def raised_by_torch_distributed(err: BaseException) -> bool:
    """Whether `err` came from torch.distributed: a ``DistError`` (nccl's watchdog, the stores), or an exception raised
    by torch's own code (the innermost traceback frame is in torch) under a torch.distributed frame. A gloo collective
    raises a plain RuntimeError, in torch/distributed itself or, for FSDP2's gathers, from the custom-op layer
    (torch/_library) those call. Decided by type and origin, never by message: a plug-in's or a library's
    RuntimeError saying "timed out" is not a stalled rank."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    files = []
    tb = err.__traceback__
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return bool(files) and files[-1].startswith(_TORCH_DIR + os.sep) and any(
        f.startswith(_TORCH_DISTRIBUTED_DIR + os.sep) for f in files)


def collective_failure(err: BaseException, timeout_s: float) -> str | None:
    """A one-line explanation when `err` is a collective that timed out or lost its peer (a stalled, killed or
    unreachable rank), else None. Only errors :func:`raised_by_torch_distributed` qualify; the message then says
    which of the two it was."""
    if not raised_by_torch_distributed(err):
        return None
    text = str(err)
    if "Timed out" in text or "timed out" in text or "Watchdog caught collective operation timeout" in text:
        return (f"a collective timed out after {timeout_s:g} s (trainer.collective_timeout_s): another rank is "
                f"stalled or unreachable ({text.strip().splitlines()[-1][:200]})")
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return f"another rank died or closed its connection ({text.strip().splitlines()[-1][:200]})"
    return None


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of `tensor` over ranks, returned as a new tensor (gloo has no AVG op, so SUM / world size).

    A single process gets a copy. Integer tensors are averaged in float32. Under nccl a CPU tensor is reduced
    on the current CUDA device and returned on the CPU.
    """
    out = tensor.detach().clone()
    if not out.is_floating_point():
        out = out.float()
    if not is_distributed():
        return out
    on_cpu_with_nccl = out.device.type == "cpu" and dist.get_backend() == "nccl"
    if on_cpu_with_nccl:  # nccl only reduces CUDA tensors
        out = out.cuda()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    out /= get_world_size()
    return out.cpu() if on_cpu_with_nccl else out


def all_gather_list(items: list) -> list:
    """The concatenation over ranks (in rank order) of every rank's picklable list; a copy of it in one process."""
    if not is_distributed():
        return list(items)
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def _reduce(values: list[float], op: Any) -> list[float]:
    """Float64 all-reduce of a few host scalars (on the current CUDA device when there is one: NCCL needs it)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if is_distributed():
        dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_max(value: float) -> float:
    """The maximum of a host scalar over ranks."""
    return _reduce([value], dist.ReduceOp.MAX)[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sums of a few host scalars over ranks."""
    return _reduce(values, dist.ReduceOp.SUM)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `obj` on every rank (other ranks' argument is ignored)."""
    if not is_distributed():
        return obj
    holder = [obj if get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python `random`, numpy's global RNG and torch (CPU and all CUDA devices) for this rank.

    Rank r uses ``(seed + r * RANK_SEED_STRIDE) % 2**32`` so ranks draw different samples. Models that are
    randomly initialised (not loaded) must be built under a rank-independent seed, e.g. inside
    ``torch.random.fork_rng`` with ``torch.manual_seed(seed)``. Returns the seed used.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    rank_seed = (seed + rank * RANK_SEED_STRIDE) % 2**32
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)  # also seeds every CUDA device
    return rank_seed


def set_deterministic(enabled: bool = True) -> None:
    """Turn deterministic algorithms on or off: torch.use_deterministic_algorithms, cuDNN flags, and
    CUBLAS_WORKSPACE_CONFIG (which cuBLAS reads at first use, so call this before any CUDA matmul)."""
    if enabled:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def shard_groups(env_groups: int, world_size: int, rank: int) -> range:
    """The consecutive env groups rank `rank` owns: ``env_groups / world_size`` of them.

    >>> shard_groups(8, 2, 1)
    range(4, 8)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if env_groups < 1 or env_groups % world_size:
        raise ValueError(
            f"env_groups ({env_groups}) must be a positive multiple of world_size ({world_size}): "
            f"each rank owns env_groups / world_size groups"
        )
    per_rank = env_groups // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def rng_state() -> dict[str, Any]:
    """This process's python `random`, numpy global and torch (CPU, and CUDA when initialised) RNG states,
    as a JSON-serialisable dict. Per rank: each rank saves and restores its own.

    numpy ``Generator`` objects (``np.random.default_rng``) are not global and are not captured.
    """
    version, internal, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states captured by :func:`rng_state` (exact: the next draws repeat)."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
