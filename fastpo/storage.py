"""The run directory across ranks and nodes: which ranks share a disk, claiming a run directory, full disks.

    layout = storage.disk_layout(run_dir)        # collective: which ranks see the same run_dir on disk
    storage.claim_run_dir(run_dir, resume="never", overwrite=False, config_hash=h)   # collective; ConfigError
    with storage.disk_full_as_error(path):       # ENOSPC / torch's "unexpected pos" -> DiskFullError
        ...

Node-local disks. Every rank writes a probe file into its run directory and looks for the others' probes: ranks
that see each other's probes share a disk, and the lowest of them is that disk's *leader* (it creates, publishes
and prunes checkpoint folders there). With one shared filesystem there is one leader, rank 0. With node-local
disks every node has its own leader and :mod:`fastpo.checkpoint` copies each checkpoint file to every disk, so
every node resumes without reading another node's disk.

Fault injection for tests: ``FASTPO_INJECT_DISK_FULL=checkpoint`` (or ``export``) makes the next checkpoint
(export) write fail the way a full disk does (a half-written file, then ``OSError(ENOSPC)``) on rank 0.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from . import distributed as du
from .config import ConfigError

#: Env var of the disk-full test hook: ``checkpoint`` or ``export`` (comma-separated for both).
INJECT_DISK_FULL_ENV = "FASTPO_INJECT_DISK_FULL"
#: What makes a run directory "hold a run" (refused by resume=never without trainer.overwrite).
RUN_FILES = ("checkpoints", "metrics.jsonl", "hf", "report.txt", "curves.png", "run_info.json")
# torch's zip writer reports a short write as "unexpected pos N vs M" (a RuntimeError without an errno), safetensors
# as SafetensorError("... No space left on device (os error 28)")
_SHORT_WRITE_MARKERS = ("unexpected pos", "No space left on device", "file write failed", "os error 28")


class DiskFullError(OSError):
    """A write failed because the disk is full; the message names the path and the free space."""


@dataclass(frozen=True)
class DiskLayout:
    """Which ranks share this rank's run directory on disk.

    Attributes:
        leader: the lowest rank that sees the same run directory as this rank (writes shared files there).
        leaders: every disk's leader, ascending (one entry: a shared filesystem).
        disk_of: rank -> the leader of that rank's disk (length world size).
    """

    leader: int
    leaders: tuple[int, ...]
    disk_of: tuple[int, ...]

    @property
    def is_leader(self) -> bool:
        return du.get_rank() == self.leader

    @property
    def shared(self) -> bool:
        return len(self.leaders) == 1


_LAYOUTS: dict[str, DiskLayout] = {}


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (``[obj]`` in a single process)."""
    if not du.is_distributed():
        return [obj]
    out: list[Any] = [None] * du.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def disk_layout(run_dir: str | os.PathLike) -> DiskLayout:
    """Probe (once per run directory and process; collective) which ranks share `run_dir` on disk; creates it."""
    run_dir = Path(run_dir)
    key = str(run_dir.absolute())
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    rank, world = du.get_rank(), du.get_world_size()
    run_dir.mkdir(parents=True, exist_ok=True)
    if world == 1:
        layout = DiskLayout(0, (0,), (0,))
    else:
        nonce = du.broadcast_object(uuid.uuid4().hex)
        probe = run_dir / f".disk-probe-{nonce}-{rank}"
        probe.write_text(str(rank))
        du.barrier()
        seen = [r for r in range(world) if (run_dir / f".disk-probe-{nonce}-{r}").is_file()]
        du.barrier()
        probe.unlink()
        disk_of = tuple(min(s) for s in all_gather_object(seen))
        layout = DiskLayout(disk_of[rank], tuple(sorted(set(disk_of))), disk_of)
    _LAYOUTS[key] = layout
    return layout


def claim_run_dir(run_dir: str | os.PathLike, resume: str, overwrite: bool, config_hash: str | None = None) -> None:
    """Check, on every rank, that this run may use `run_dir`; collective, the same ConfigError on every rank.

    Refused: ranks started with different run directories or configs (compared as given, so node-local disks
    may mount the same relative path in different places); ``resume="never"`` on a directory that already holds
    a run (any of :data:`RUN_FILES` on any node's disk) unless `overwrite`, which then deletes those files on
    every disk so the new run starts a fresh ``metrics.jsonl``.
    """
    given = all_gather_object((str(run_dir), config_hash))
    if len(set(given)) > 1:
        detail = "; ".join(f"rank {r}: run_dir {d!r}, config hash {h}" for r, (d, h) in enumerate(given))
        raise ConfigError(f"the ranks were started with different trainer.run_dir or configs ({detail}); start "
                          f"every node with the same command line")
    layout = disk_layout(run_dir)
    run_dir = Path(run_dir)
    found = [f"{run_dir / n}" for n in RUN_FILES if (run_dir / n).exists()] if layout.is_leader else []
    found = sorted({f for part in all_gather_object(found) for f in part})
    if resume != "never" or not found:
        return
    if not overwrite:
        raise ConfigError(f"trainer.resume=never but trainer.run_dir {str(run_dir)!r} already holds a run "
                          f"({', '.join(found)}); pass --trainer.overwrite true to delete it and start fresh, "
                          f"--trainer.resume auto to continue it, or choose another trainer.run_dir")
    if layout.is_leader:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    du.barrier()
    du.print0(f"trainer.overwrite: deleted the previous run in {run_dir} ({', '.join(found)})")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _is_disk_full(err: BaseException) -> bool:
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:  # DCP wraps the per-rank failures (CheckpointException.failures) and chains causes
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in _SHORT_WRITE_MARKERS):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():
                stack.append(f[0] if isinstance(f, tuple) else f)
    return False


@contextlib.contextmanager
def disk_full_as_error(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Re-raise a write failure caused by a full disk as :class:`DiskFullError` naming `what`, `path` and the free
    space (torch reports it as ``unexpected pos N vs M``); other errors pass through unchanged."""
    try:
        yield
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        if isinstance(err, DiskFullError) or not _is_disk_full(err):
            raise
        free = free_bytes(path)
        space = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        raise DiskFullError(errno.ENOSPC, f"disk full while writing the {what} to {path} ({space}); free some "
                                          f"space or point trainer.run_dir elsewhere, then resume") from err


def inject_disk_full(stage: str, path: Path) -> None:
    """The ``FASTPO_INJECT_DISK_FULL`` test hook: on rank 0, leave a half-written file in `path` and raise ENOSPC."""
    stages = {s.strip() for s in os.environ.get(INJECT_DISK_FULL_ENV, "").split(",") if s.strip()}
    if stage in stages and du.is_main():
        (path / "injected.partial").write_bytes(b"\0" * 598)
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "injected.partial"))


def agree(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank and fail on every rank if it failed on any (collective), so a
    rank-local write error cannot strand the other ranks at the next barrier. The failing rank re-raises its own
    exception; the others raise the same type when it is a DiskFullError, else RuntimeError naming the rank."""
    try:
        result, failure = fn(*args, **kwargs), None
    except Exception as err:  # re-raised below, after the other ranks learnt about it
        result, failure, local = None, (type(err).__name__, str(err), isinstance(err, DiskFullError)), err
    failures = [(r, f) for r, f in enumerate(all_gather_object(failure)) if f is not None]
    if failure is not None:
        raise local
    if failures:
        rank, (name, msg, full) = failures[0]
        if full:
            raise DiskFullError(errno.ENOSPC, f"rank {rank}: {msg}")
        raise RuntimeError(f"rank {rank} failed: {name}: {msg}")
    return result
