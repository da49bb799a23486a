"""The run directory across ranks and nodes: which ranks share a disk, claiming a run directory, full disks.

    layout = storage.disk_layout(run_dir)        # collective: which ranks see the same run_dir on disk
    storage.claim_run_dir(run_dir, resume="never", overwrite=False, config_hash=h)   # collective; ConfigError
    lock = storage.lock_run_dir(run_dir)         # collective; rank 0 holds <run_dir>/.lock; ConfigError if taken
    lock.release()                               # rank 0 (None on the other ranks), also on errors
    with storage.disk_full_as_error(path):       # ENOSPC / torch's "unexpected pos" -> DiskFullError
        ...

Node-local disks. Every rank writes a probe file into its run directory and looks for the others' probes: ranks
that see each other's probes share a disk, and the lowest of them is that disk's *leader* (it creates, publishes
and prunes checkpoint folders there). With one shared filesystem there is one leader, rank 0. With node-local
disks every node has its own leader and :mod:`fastpo.checkpoint` copies each checkpoint file to every disk, so
every node resumes without reading another node's disk.

One trainer per run directory: rank 0 holds ``<run_dir>/.lock`` (``fcntl.flock`` on it, and the holder's host,
pid and start time in it) from before the first write until the run ends. A second trainer is refused naming the
holder; the lock of a process that no longer runs on this host is taken over with a note; one written on another
host is refused (this host cannot check that process) with how to remove it.

Fault injection for tests: ``FASTPO_INJECT_DISK_FULL=checkpoint`` (or ``export``) makes the next checkpoint
(export) write fail the way a full disk does (a half-written file, then ``OSError(ENOSPC)``) on rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import distributed as du
from .config import ConfigError

logger = logging.getLogger(__name__)

#: Env var of the disk-full test hook: ``checkpoint`` or ``export`` (comma-separated for both).
INJECT_DISK_FULL_ENV = "FASTPO_INJECT_DISK_FULL"
#: What makes a run directory "hold a run" (refused by resume=never without trainer.overwrite).
RUN_FILES = ("checkpoints", "metrics.jsonl", "hf", "report.txt", "curves.png", "run_info.json")
#: What shows a started or finished run (metrics.jsonl only with a row): ``resume="auto"`` refuses them without a
#: checkpoint folder to continue from, unless trainer.overwrite.
STARTED_RUN_FILES = ("metrics.jsonl", "hf", "report.txt", "curves.png")
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


def _inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it, symlinks resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _has_rows(path: Path) -> bool:
    """A metrics.jsonl that holds at least one row (anything but whitespace)."""
    try:
        with open(path, "rb") as f:
            return any(line.strip() for line in f)
    except OSError:
        return False


def _run_state(run_dir: Path) -> tuple[list[str], list[str], bool]:
    """What this disk holds: (every :data:`RUN_FILES` entry present, the entries that show a started or finished run
    (:data:`STARTED_RUN_FILES`, metrics.jsonl only with a row), whether ``checkpoints/`` holds a ``step-*`` folder)."""
    found = [str(run_dir / n) for n in RUN_FILES if (run_dir / n).exists()]
    started = [str(run_dir / n) for n in STARTED_RUN_FILES
               if (run_dir / n).exists() and (n != "metrics.jsonl" or _has_rows(run_dir / n))]
    ckpt = run_dir / "checkpoints"
    has_checkpoint = ckpt.is_dir() and any(re.fullmatch(r"step-\d+", d.name) and d.is_dir() for d in ckpt.iterdir())
    return found, started, has_checkpoint


def claim_run_dir(run_dir: str | os.PathLike, resume: str, overwrite: bool, config_hash: str | None = None,
                  delete: bool = True, model_paths: dict[str, str] | None = None) -> None:
    """Check, on every rank, that this run may use `run_dir`, then (with `delete`) delete what `overwrite` replaces;
    collective, the same ConfigError on every rank. Every check runs before anything is deleted.

    Refused: ranks started with different run directories, configs, `resume` or `overwrite` (compared as given,
    so node-local disks may mount the same relative path in different places); ``resume="never"`` on a directory
    that already holds a run (any of :data:`RUN_FILES` on any node's disk) unless `overwrite`; ``resume="auto"``
    on a directory that holds a started or finished run (a metrics.jsonl with rows, ``hf/``, ``report.txt``,
    ``curves.png``) but no checkpoint folder to continue from, unless `overwrite`; an `overwrite` that would delete
    a model the run loads
    (`model_paths`: config field -> path, e.g. ``{"model.path": "runs/x/hf"}``). With `overwrite` (where it
    applies) those files are deleted on every disk so the new run starts a fresh ``metrics.jsonl``; ``delete=False``
    runs the checks only (the entry point deletes after its last check, under the run directory's lock).
    """
    # resume and overwrite are outside the config hash (they do not change the math) but decide below whether a
    # rank raises or goes on to the next collective: ranks that disagree would leave the others waiting in it
    given = all_gather_object((str(run_dir), config_hash, str(resume), bool(overwrite)))
    if len(set(given)) > 1:
        detail = "; ".join(f"rank {r}: run_dir {d!r}, resume {res!r}, overwrite {ow}, config hash {h}"
                           for r, (d, h, res, ow) in enumerate(given))
        raise ConfigError(f"the ranks were started with different trainer.run_dir or configs (trainer.resume and "
                          f"trainer.overwrite included) ({detail}); start every node with the same command line")
    layout = disk_layout(run_dir)
    run_dir = Path(run_dir)
    found, started, has_checkpoint = _run_state(run_dir) if layout.is_leader else ([], [], False)
    states = all_gather_object((found, started, has_checkpoint))
    found = sorted({f for part, _, _ in states for f in part})
    started = sorted({f for _, part, _ in states for f in part})
    has_checkpoint = any(c for _, _, c in states)
    if resume == "never" and found:
        if not overwrite:
            raise ConfigError(f"trainer.resume=never but trainer.run_dir {str(run_dir)!r} already holds a run "
                              f"({', '.join(found)}); pass --trainer.overwrite true to delete it and start fresh, "
                              f"--trainer.resume auto to continue it, or choose another trainer.run_dir")
    elif resume == "auto" and started and not has_checkpoint:
        if not overwrite:
            raise ConfigError(f"trainer.resume=auto but trainer.run_dir {str(run_dir)!r} holds a started or finished "
                              f"run ({', '.join(started)}) and no checkpoint to continue it from (no "
                              f"{run_dir / 'checkpoints'}/step-*); pass --trainer.overwrite true to delete it and "
                              f"start fresh, or choose another trainer.run_dir")
    else:
        return
    # overwrite: nothing that the run reads may lie in what is deleted
    problems = [f"{field} {path!r} lies inside {f!r}, which trainer.overwrite would delete before the model loads; "
                f"copy the model out of trainer.run_dir {str(run_dir)!r} first, or choose another trainer.run_dir"
                for field, path in (model_paths or {}).items() if path and os.path.exists(os.path.expanduser(path))
                for f in found if _inside(os.path.expanduser(path), f)] if layout.is_leader else []
    problems = [p for part in all_gather_object(problems) for p in part]
    if problems:
        raise ConfigError(problems[0])
    if not delete:
        return
    if layout.is_leader:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    du.barrier()
    logger.info(f"trainer.overwrite: deleted the previous run in {run_dir} ({', '.join(found)})")


LOCK_FILE = ".lock"


def _proc_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc/<pid>/stat field 22); None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, proc_start: int | None = None) -> bool:
    """Whether process `pid` runs on this host (a zombie does not; with `proc_start`, a process that reused the pid
    does not either)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        if stat[stat.rindex(")") + 2:].split()[0] in ("Z", "X"):
            return False
    except (OSError, ValueError, IndexError):
        return True
    return proc_start is None or _proc_start(pid) in (None, proc_start)


class RunDirLock:
    """Rank 0's exclusive hold on a run directory: ``<run_dir>/.lock``, flock-ed and holding the holder's host, pid
    and start time. :meth:`release` (idempotent) deletes the file and drops the lock; a killed holder's kernel lock
    goes with it and the next run takes the stale file over (:func:`lock_run_dir`)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int, wait_s: float = 1.0) -> dict[str, Any] | None:
    """The lock file's record (None when empty or unreadable after `wait_s`: a holder may be writing it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = json.loads(os.pread(fd, 1 << 16, 0).decode() or "null")
            if isinstance(holder, dict):
                return holder
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def _who(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "a holder that has not written its host and pid"
    return f"host {holder.get('host')!r}, pid {holder.get('pid')}, started {holder.get('started')}"


def _take_lock(run_dir: Path) -> tuple[RunDirLock, str | None]:
    """Take ``<run_dir>/.lock`` (this process); returns the lock and a note when a stale one was taken over.
    ConfigError when another trainer holds it or it was written on another host."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path, host = run_dir / LOCK_FILE, socket.gethostname()
    for _ in range(10):  # a holder may delete the file between our open and our flock: then open the new one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                leftover = (holder is not None and holder.get("host") == host
                            and not pid_alive(holder.get("pid"), holder.get("proc_start")))
                raise ConfigError(
                    f"trainer.run_dir {str(run_dir)!r} is in use by another trainer ({_who(holder)}; lock file "
                    f"{path})" + ("; that pid has exited but a process it started still holds the lock: stop that "
                                  f"process (`fuser -v {path}`)" if leftover else
                                  "; wait for it to finish or stop it, or choose another trainer.run_dir")) from None
            except OSError as err:  # a filesystem without flock (ENOLCK / EOPNOTSUPP): the record alone decides
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            try:
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            holder, note = _read_holder(fd, wait_s=0.0), None
            if os.fstat(fd).st_size and holder is None:
                holder = _read_holder(fd)  # a holder on a filesystem without flock may be writing it right now
            if holder is not None:
                pid = holder.get("pid")
                if holder.get("host") != host:
                    raise ConfigError(
                        f"trainer.run_dir {str(run_dir)!r} is locked by a trainer on another host ({_who(holder)}; "
                        f"this is {host!r}), which this host cannot check; if that run is gone, delete {path} and "
                        f"start again, else choose another trainer.run_dir")
                if pid_alive(pid, holder.get("proc_start")):
                    raise ConfigError(f"trainer.run_dir {str(run_dir)!r} is in use by another trainer "
                                      f"({_who(holder)}; lock file {path}); wait for it to finish or stop it, or "
                                      f"choose another trainer.run_dir")
                note = (f"trainer.run_dir: taking over the stale lock {path} of pid {pid} on {host} (started "
                        f"{holder.get('started')}; no longer running)")
            elif os.fstat(fd).st_size:
                note = f"trainer.run_dir: taking over the unreadable stale lock {path}"
            record = {"host": host, "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
                      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
            return RunDirLock(path, fd), note
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise ConfigError(f"trainer.run_dir {str(run_dir)!r}: could not take the lock {path} (it kept being replaced); "
                      f"another trainer is starting on this run directory")


def lock_run_dir(run_dir: str | os.PathLike) -> RunDirLock | None:
    """Take the run directory's exclusive lock on rank 0 (collective: every rank learns the outcome, no rank hangs).

    Returns the lock on rank 0 (release it with :meth:`RunDirLock.release`, also on errors), None on the other
    ranks. Raises the same ConfigError on every rank when another trainer holds the lock (its host and pid) or
    the lock was written on another host. A lock left by a process that no longer runs on this host is taken
    over with a note. Only rank 0's disk gets a lock (node-local disks of other nodes are not locked).
    """
    lock, outcome = None, None
    if du.is_main():
        try:
            lock, note = _take_lock(Path(run_dir))
            if note:
                logger.info(note)
        except ConfigError as err:
            outcome = ("config", str(err))
        except OSError as err:
            outcome = ("config", f"trainer.run_dir {str(run_dir)!r}: cannot write the lock file "
                                 f"{Path(run_dir) / LOCK_FILE}: {err}; pass a writable directory")
        except Exception as err:  # re-raised below once the other ranks know
            outcome, failure = ("error", f"{type(err).__name__}: {err}"), err
    outcome = du.broadcast_object(outcome)
    if outcome is None:
        return lock
    if outcome[0] == "config":
        raise ConfigError(outcome[1])
    if du.is_main():
        raise failure
    raise RuntimeError(f"rank 0 failed to lock trainer.run_dir {str(run_dir)!r}: {outcome[1]}")


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
    # imported by the writes that use it, not with this module: torch.distributed.checkpoint takes ~1 s to import,
    # and the config checks import this module
    from torch.distributed.checkpoint.api import CheckpointException

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


class RankFailedError(RuntimeError):
    """Raised by :func:`agree` on the ranks where the step succeeded: another rank's failure, named with its rank,
    type and message (that rank reports its own)."""


def agree(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank and fail on every rank if it failed on any (collective), so a
    rank-local write error cannot strand the other ranks at the next barrier. The failing rank re-raises its own
    exception; the others raise the same type when it is a DiskFullError, else :class:`RankFailedError` naming the
    rank."""
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
        raise RankFailedError(f"rank {rank} failed: {name}: {msg}")
    return result
