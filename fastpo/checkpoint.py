"""Checkpoints: model / optimiser / scheduler via torch.distributed.checkpoint (DCP), trainer state as JSON,
per-rank RNG states, atomic publication, pruning, resume with a config-hash check, and Hugging Face export.

    from fastpo import checkpoint
    objects = {"actor": model, "actor_optim": optim, "actor_sched": sched}   # name -> stateful object
    checkpoint.save(run_dir, step, objects, {"env_seed": 1234, "weight_version": 7},
                    config_hash=cfg_hash, keep_last=3)                  # every rank calls it
    trainer_state = checkpoint.resume(run_dir, objects, mode="auto", config_hash=cfg_hash)  # None: fresh
    checkpoint.export_hf(model, tokenizer, run_dir / "hf")                # every rank calls it

Layout of ``<run_dir>/checkpoints/step-000042/``:
    *.distcp, .metadata      DCP shards of every object in `model_state` (each rank writes its own shards)
    rng-rank-00000.json ...  each rank's python / numpy / torch RNG state (fastpo.distributed.rng_state)
    trainer_state.json       {"step", "world_size", "config_hash", "num_threads", "trainer_state": {...}}
    COMPLETE                 the manifest {"step", "files": {name: [sha256, size]}} of every other file, written
                             last; a directory without it is never resumed, one whose files do not match it is
                             skipped by ``resume="auto"`` (with a message) and refused by :func:`load`

Atomicity: everything is written into ``step-000042.tmp-<pid of rank 0>``; after every rank has reported its
files (name, size, sha256) rank 0's manifest goes into COMPLETE and the directory is renamed. A crash leaves a
``.tmp-`` directory, which :func:`latest` ignores and the next save removes.

Retention (``keep_last``): after each save, :func:`retention_plan` picks the steps to delete, once for all disks;
the newest intact checkpoint is never deleted and a damaged one does not count. A deleted checkpoint is first renamed
to ``step-000042.discard``, so a kill during the deletion leaves either a complete checkpoint or an ignored folder.

Multi-node: `run_dir` may be one shared filesystem or a node-local disk per node (``fastpo.storage.disk_layout``
finds out). On node-local disks every checkpoint file is copied to every node's disk before COMPLETE is written
there, so each node resumes from its own disk (at the cost of sending the checkpoint once per extra node).

Trust: loading a checkpoint unpickles its DCP ``.metadata`` (torch.distributed.checkpoint does), which can run
code: load only checkpoints written by you or your own runs. The sha256 manifest detects damage, not tampering.

Models and optimisers go through ``torch.distributed.checkpoint.state_dict`` (get/set_model_state_dict,
get/set_optimizer_state_dict), so FSDP2-sharded parameters and optimiser states round-trip as DTensors
(each rank saves and loads its own shard) and plain modules work in a single process without a process
group. An optimiser is paired with the module in `model_state` that owns its parameters. Anything else
(LR schedulers, ...) only needs ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import distributed as du
from . import storage
from .log import ALL_RANKS

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
#: Written last into a Hugging Face export (:func:`export_hf`); a folder without it is a cut-short export.
EXPORT_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp-\d+$")
#: A checkpoint being deleted by the retention (:func:`_prune`), or an older save of a step being replaced.
_DISCARD_DIR = re.compile(r"^step-(\d+)\.discard$")
#: Test hook (see :func:`_delete_folder`): a kill -9 in the middle of a prune.
KILL_DURING_PRUNE_ENV = "FASTPO_INJECT_KILL_DURING_PRUNE"
#: Checkpoint folder -> its COMPLETE marker's (inode, size, mtime) when this process wrote or verified it: the
#: retention checks such a checkpoint without hashing its files again (resume always hashes, in a new process).
_INTACT: dict[str, tuple[int, int, int]] = {}
#: A Hugging Face export being written (:func:`export_hf` into ``<out_dir>.tmp-<pid>``).
_HF_TMP_DIR = re.compile(r"^hf\.tmp-(\d+)$")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _rng_file(rank: int) -> str:
    return f"rng-rank-{rank:05d}.json"


def _owning_module(optim: torch.optim.Optimizer, model_state: dict[str, Any], name: str) -> nn.Module:
    """The module in `model_state` whose parameters include all of `optim`'s parameters."""
    opt_params = {id(p) for group in optim.param_groups for p in group["params"]}
    for obj in model_state.values():
        if isinstance(obj, nn.Module) and opt_params <= {id(p) for p in obj.parameters()}:
            return obj
    raise ValueError(
        f"optimizer {name!r}: no nn.Module in model_state owns all of its parameters; "
        f"pass the model it optimises in the same dict (got entries {sorted(model_state)})"
    )


def _state_dicts(model_state: dict[str, Any]) -> dict[str, Any]:
    """name -> state dict, with DCP-friendly (possibly sharded) model and optimiser states."""
    out: dict[str, Any] = {}
    for name, obj in model_state.items():
        if isinstance(obj, nn.Module):
            out[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            out[name] = get_optimizer_state_dict(_owning_module(obj, model_state, name), obj)
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            out[name] = obj.state_dict()
        else:
            raise TypeError(f"model_state[{name!r}] has no state_dict/load_state_dict: {type(obj).__name__}")
    return out


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that there is no process group; that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _hash_file(path: Path) -> list[Any]:
    """[sha256 hex digest, size in bytes] of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return [h.hexdigest(), path.stat().st_size]


def _write_rank_files(tmp: Path, step: int, meta: dict[str, Any]) -> dict[str, list[Any]]:
    """This rank's RNG file (and rank 0's trainer state) next to its DCP shards; returns name -> [sha256, size]
    of every file this rank wrote."""
    rank = du.get_rank()
    storage.inject_disk_full("checkpoint", tmp)
    _write_json(tmp / _rng_file(rank), du.rng_state())
    names = [p.name for p in tmp.glob(f"__{rank}_*.distcp")] + [_rng_file(rank)]
    if rank == 0:
        _write_json(tmp / TRAINER_STATE_FILE, meta)
        names += [".metadata", TRAINER_STATE_FILE]
    return {name: _hash_file(tmp / name) for name in sorted(names)}


def _replicate(tmp: Path, files_by_rank: list[dict[str, list[Any]]], layout: storage.DiskLayout) -> None:
    """Node-local disks: copy every rank's files to every other disk (collective), so each disk holds the whole
    checkpoint. DCP stores a replicated tensor once, in the file of whichever rank it picked, so a rank's own
    shard files alone would not always be enough to resume."""
    rank = du.get_rank()
    for owner, files in enumerate(files_by_rank):
        for name in sorted(files):
            data = du.broadcast_object((tmp / name).read_bytes() if rank == owner else None, src=owner)
            if layout.is_leader and layout.leader != layout.disk_of[owner]:
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())


def _publish(tmp: Path, final: Path, step: int, manifest: dict[str, list[Any]]) -> None:
    """On each disk's leader: write the COMPLETE marker (the manifest) and rename the folder into place (an older
    save of the same step is first renamed out of the way, then deleted)."""
    if not storage.disk_layout(final.parent.parent).is_leader:
        return
    _write_json(tmp / MARKER, {"step": step, "files": manifest})  # last file written, fsynced before the rename
    old = _set_aside(final) if final.exists() else None
    os.replace(tmp, final)
    if old is not None:
        _delete_folder(old)


def save(
    run_dir: str | os.PathLike,
    step: int,
    model_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int | None = 3,
    config_hash: str | None = None,
) -> Path:
    """Write ``<run_dir>/checkpoints/step-000150/`` (zero-padded step) atomically; every rank must call it (collective).

    Args:
        step: training step (the checkpoint is named after it; re-saving a step replaces it).
        model_state: name -> nn.Module / Optimizer / object with state_dict() and load_state_dict().
        trainer_state: JSON-serialisable trainer state (env seed counters, weight version, ...).
        keep_last: keep this many newest intact checkpoints (None keeps all); :func:`retention_plan` says which
            older ones are deleted.
        config_hash: the run's config hash; :func:`resume` refuses a different one.

    Returns:
        The final checkpoint directory.

    Raises:
        fastpo.storage.DiskFullError: the disk filled up (on every rank; the previous checkpoints are intact).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    try:  # checked on every rank before any collective, so a bad value cannot strand ranks at a barrier
        json.dumps(trainer_state)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable: {e}") from e
    layout = storage.disk_layout(run_dir)
    root = checkpoint_dir(run_dir)
    final = root / step_dir_name(step)
    tmp = root / f"{step_dir_name(step)}.tmp-{du.broadcast_object(os.getpid())}"
    if layout.is_leader:
        if tmp.exists():  # left by an earlier failed save of this step in this process
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    du.barrier()

    meta = {"step": step, "world_size": du.get_world_size(), "config_hash": config_hash,
            "num_threads": torch.get_num_threads(), "trainer_state": trainer_state}
    with storage.disk_full_as_error(tmp, f"checkpoint of step {step}"):
        with _single_process_quiet():  # a failure on any rank raises on every rank (DCP gathers them)
            dcp.save(_state_dicts(model_state), checkpoint_id=str(tmp), no_dist=not du.is_distributed())
        files_by_rank = storage.all_gather_object(storage.agree(_write_rank_files, tmp, step, meta))
        if not layout.shared:
            storage.agree(_replicate, tmp, files_by_rank, layout)
        # every rank has reported its files (and they are on every disk): only now is the checkpoint complete
        manifest = {name: digest for files in files_by_rank for name, digest in files.items()}
        storage.agree(_publish, tmp, final, step, manifest)
    _remember_intact(final)  # built from the files just hashed: no need to read it back for the retention
    storage.agree(_prune, root, retention_plan(root, keep_last, step), step)
    du.barrier()
    return final


def retention_plan(root: Path, keep: int | None, current_step: int) -> list[int]:
    """The steps to delete so that `keep` intact checkpoints remain (collective; the same list on every rank).

    Counted from the newest step down, among the steps up to `current_step` (a resumed run that went back to an
    older checkpoint leaves the later ones alone): a checkpoint counts when it is intact on every disk (resume's
    check, :func:`verify`; one this process wrote or verified is not hashed again, only its files' presence, sizes
    and JSON are checked). A damaged one (no COMPLETE marker, a missing file, a bad manifest, a failed sha256) does
    not count and is kept while it is newer than the `keep`-th intact one. Every step older than that one is in the
    plan. Fewer than `keep` intact checkpoints: nothing is deleted, so the newest intact checkpoint never is.

    The steps come from every disk (node-local disks may differ after a crash) and each verdict is agreed by all
    ranks, so every disk deletes the same steps; rank 0's list is broadcast to make that explicit.
    """
    if keep is None:
        return []
    local = storage.agree(lambda: [s for s, _ in _complete_steps(root)])
    steps = sorted({s for part in storage.all_gather_object(local) for s in part if s <= current_step})
    intact = 0
    plan: list[int] = []
    for step in reversed(steps):
        if _verify_everywhere(root / step_dir_name(step), trust_remembered=True) is None:
            intact += 1
            if intact == keep:
                plan = [s for s in steps if s < step]
                break
    return du.broadcast_object(plan)


def _prune(root: Path, plan: list[int], current_step: int) -> None:
    """On each disk's leader: delete the checkpoints of `plan` (:func:`retention_plan`), the folders of killed
    deletions, and stale ``.tmp-`` folders up to the current step. A checkpoint is first renamed to
    ``step-N.discard`` (atomic: it is complete under its name or ignored by everything), then emptied; a kill in
    between leaves a ``.discard`` folder that the next prune or start-up removes."""
    if not storage.disk_layout(root.parent).is_leader:
        return
    for d in root.iterdir():
        m = _TMP_DIR.match(d.name)
        if m and int(m.group(1)) <= current_step:
            shutil.rmtree(d, ignore_errors=True)
        elif _DISCARD_DIR.match(d.name):
            _delete_folder(d)
    for step in plan:
        d = root / step_dir_name(step)
        if d.is_dir():
            _delete_folder(_set_aside(d))


def _set_aside(d: Path) -> Path:
    """Rename the checkpoint folder `d` to ``<d>.discard`` (replacing a leftover of that name); returns the new path."""
    aside = d.with_name(f"{d.name}.discard")
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(d, aside)
    _INTACT.pop(str(d), None)
    return aside


def _delete_folder(d: Path) -> None:
    """Delete a set-aside checkpoint folder file by file; a failure is a warning (the run goes on, the next prune
    retries). Test hook: ``FASTPO_INJECT_KILL_DURING_PRUNE=1`` kills this process (SIGKILL) right after the first
    file is deleted."""
    kill = os.environ.get(KILL_DURING_PRUNE_ENV) == "1"
    try:
        for p in sorted(d.iterdir()):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
        d.rmdir()
    except OSError as err:
        logger.warning(f"warning: could not delete the old checkpoint folder {d}: {err}", extra=ALL_RANKS)


def remove_stale_temp(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders of writes that never finished: ``<run_dir>/hf.tmp-<pid>`` (an export),
    ``<run_dir>/checkpoints/step-*.tmp-<pid>`` (a checkpoint, whatever its step) and ``step-*.discard`` (a pruned
    checkpoint whose deletion was cut short); one printed line per removal.
    Returns the removed folders. Collective (every rank calls it; each disk's leader cleans its disk).

    Only for a process that holds the run directory (the entry point calls it at start-up, under the run
    directory's lock, before anything is written): then no other trainer writes there and every such folder was
    left by a killed run, whatever its pid.
    """
    run_dir = Path(run_dir)
    if not storage.disk_layout(run_dir).is_leader:
        return []
    root = checkpoint_dir(run_dir)
    candidates = [d for d in run_dir.iterdir() if _HF_TMP_DIR.match(d.name)] if run_dir.is_dir() else []
    candidates += [d for d in root.iterdir() if _TMP_DIR.match(d.name) or _DISCARD_DIR.match(d.name)] \
        if root.is_dir() else []
    removed = []
    for d in sorted(candidates):
        what = ("an unfinished deletion of an old checkpoint" if _DISCARD_DIR.match(d.name) else
                f"an unfinished write of pid {d.name.rsplit('-', 1)[1]}, which no longer holds this run directory")
        try:
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d)
            else:
                d.unlink()
        except OSError as err:
            logger.warning(f"warning: could not remove the stale temporary folder {d}: {err}", extra=ALL_RANKS)
            continue
        removed.append(d)
        logger.info(f"removed the stale temporary folder {d} ({what})", extra=ALL_RANKS)  # a disk's leader
    return removed


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MARKER).is_file():
            out.append((int(m.group(1)), d))
    return out


def latest(run_dir: str | os.PathLike) -> Path | None:
    """Newest complete checkpoint (``step-000150`` with its COMPLETE marker) under `run_dir`, or None.
    ``.tmp-`` directories and directories without the marker are ignored; the files are not verified
    (:func:`verify`, :func:`resume` do that)."""
    complete = _complete_steps(checkpoint_dir(run_dir))
    return max(complete)[1] if complete else None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's trainer_state.json: {"step", "world_size", "config_hash", "num_threads", "trainer_state"}."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    return json.loads((path / TRAINER_STATE_FILE).read_text())


def verify(path: str | os.PathLike, part: tuple[int, int] = (0, 1), hashes: bool = True) -> str | None:
    """Check a checkpoint folder against the manifest in its COMPLETE marker (every file present, with its size
    and sha256). Returns None when intact, else what is wrong. Checkpoints written before the manifest existed
    only get their JSON files checked.

    Args:
        part: (i, n) hashes only every n-th file of the sorted manifest starting at the i-th, so n processes
            reading one disk can share the work; sizes and JSON files are always checked.
        hashes: False checks presence, sizes and JSON files only (no file is read beyond those).
    """
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
        files = marker.get("files") if isinstance(marker, dict) else None
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} marker ({e})"
    for k, (name, (sha, size)) in enumerate(sorted((files or {}).items())):
        p = path / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if hashes and k % part[1] == part[0] and _hash_file(p)[0] != sha:
            return f"{name} fails its sha256 check (flipped or overwritten bytes)"
    try:
        meta = json.loads((path / TRAINER_STATE_FILE).read_text())
        if not isinstance(meta, dict) or not {"step", "trainer_state"} <= set(meta):
            return f"{TRAINER_STATE_FILE} lacks step / trainer_state"
    except (OSError, ValueError) as e:
        return f"unreadable {TRAINER_STATE_FILE} ({e})"
    return None


def _marker_signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = (path / MARKER).stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _remember_intact(path: Path) -> None:
    """Note that `path` is intact as this process sees it now (written or verified by it)."""
    signature = _marker_signature(path)
    if signature is not None:
        _INTACT[str(path)] = signature


def _verify_everywhere(path: Path, trust_remembered: bool = False) -> str | None:
    """:func:`verify` by the ranks of each node together (each hashes its share of the files: node-local disks each
    hold a copy), agreed by all ranks; the first problem found, with the rank that saw it when there are several.
    With `trust_remembered` a rank does not hash a checkpoint this process wrote or verified (same marker): it
    checks only that its files are present with their sizes and that its JSON files parse."""
    part = (int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    signature = _marker_signature(path) if trust_remembered else None
    remembered = signature is not None and _INTACT.get(str(path)) == signature
    mine = verify(path, part if 0 <= part[0] < part[1] else (0, 1), hashes=not remembered)
    problems = [(r, p) for r, p in enumerate(storage.all_gather_object(mine)) if p is not None]
    if not problems:
        _remember_intact(path)
        return None
    rank, problem = problems[0]
    return problem if du.get_world_size() == 1 else f"{problem} (seen by rank {rank})"


def load(path: str | os.PathLike, model_state: dict[str, Any], restore_rng: bool = True,
         check: bool = True) -> dict[str, Any]:
    """Restore `model_state` in place from the checkpoint at `path` (collective on every rank).

    The objects must have the same structure (and, for FSDP2, the same sharding mesh) as when saved;
    optimisers are restored before their step counters are used. Each rank restores its own RNG state
    when ``restore_rng`` and the checkpoint has a file for this rank (a different world size cannot resume
    the RNG streams exactly: rank 0 prints a note and keeps the current states). With ``check`` the files are
    first verified against the checkpoint's manifest (ValueError naming the problem).

    Trust: torch.distributed.checkpoint unpickles the ``.metadata`` file, so loading a checkpoint runs whatever
    code its author put there. Load only checkpoints you (or your own runs) wrote; the manifest detects damage,
    not tampering.

    Returns:
        The saved trainer_state dict.
    """
    path = Path(path)
    meta = read_meta(path)
    if check:
        problem = _verify_everywhere(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}")
    state = _state_dicts(model_state)  # templates: DCP loads into these tensors in place
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not du.is_distributed())
    for name, obj in model_state.items():
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer):
            set_optimizer_state_dict(_owning_module(obj, model_state, name), obj, state[name])
        else:
            obj.load_state_dict(state[name])
    rng_path = path / _rng_file(du.get_rank())
    if restore_rng:
        if rng_path.is_file() and meta.get("world_size") == du.get_world_size():
            du.set_rng_state(json.loads(rng_path.read_text()))
        else:
            logger.info(
                f"checkpoint {path.name}: saved with world_size {meta.get('world_size')}, now "
                f"{du.get_world_size()}; RNG states not restored"
            )
    threads = meta.get("num_threads")
    if threads is not None and threads != torch.get_num_threads():
        # CPU reductions split their work by thread count, so sums differ in the last bits (~1e-7 relative)
        logger.warning(f"warning: checkpoint {path.name} was saved with {threads} torch threads, this run has "
                       f"{torch.get_num_threads()} (OMP_NUM_THREADS); the resumed run is not bit-exact on CPU. Set "
                       f"OMP_NUM_THREADS={threads} to resume exactly.")
    du.barrier()
    return meta["trainer_state"]


def _check_hash(path: Path, config_hash: str | None, force: bool) -> None:
    saved = read_meta(path).get("config_hash")
    if config_hash is not None and saved is not None and saved != config_hash:
        if not force:
            raise ValueError(
                f"checkpoint {path} was saved with config hash {saved}, this run's config hash is {config_hash}; "
                f"pass that run's config (--config <run_dir>/config.json), another --trainer.run_dir, or "
                f"--trainer.resume never --trainer.overwrite true (replaces the run)"
            )
        logger.info(f"resuming {path} saved with config hash {saved} under config hash {config_hash} (forced)")


def resume(
    run_dir: str | os.PathLike,
    model_state: dict[str, Any],
    mode: str | os.PathLike = "auto",
    config_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any] | None:
    """Load the checkpoint chosen by `mode` into `model_state`; None means start fresh (collective).

    Args:
        mode: "never" (always fresh), "auto" (the newest intact checkpoint under `run_dir`, fresh if none: a
            damaged newer one, e.g. a truncated shard, a bad ``.metadata`` or JSON file, flipped bits, is skipped
            with a message on stderr naming it and why), or the path of a checkpoint directory (must be complete
            and intact).
        config_hash: this run's config hash; a checkpoint saved with a different one is refused
            (ValueError naming both) unless ``force``.

    The choice is made once (rank 0, from what every node's disk holds) and broadcast, so every rank loads the
    same step. Loading trusts the checkpoint: see :func:`load`.

    Returns:
        The saved trainer_state, or None when nothing was loaded.
    """
    if mode == "never":
        return None
    if mode != "auto":
        path = Path(mode)
        if not path.is_dir():
            raise FileNotFoundError(f"resume path {path} does not exist (mode is 'auto', 'never' or a path)")
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
        problem = _verify_everywhere(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}")
        _check_hash(path, config_hash, force)
        return load(path, model_state, check=False)
    root = checkpoint_dir(run_dir)
    steps = sorted({s for part in storage.all_gather_object([s for s, _ in _complete_steps(root)]) for s in part})
    for step in reversed(steps):
        path = root / step_dir_name(step)
        problem = _verify_everywhere(path)
        if problem is None:
            _check_hash(path, config_hash, force)  # a config change is refused, not skipped
            try:
                return load(path, model_state, check=False)
            # e.g. a checkpoint from before manifests with a bad .metadata (DCP raises a BaseException subclass)
            except (Exception, CheckpointException) as err:
                problem = f"{type(err).__name__}: {err}"
        logger.warning(f"resume: skipping checkpoint {path.name}: {problem}")
    return None


def _drop_tied_head(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without ``lm_head.weight`` when the model ties it to the input embeddings: the gathered full state dict holds
    it as a separate copy (single-process state dicts share the storage, which safetensors dedups), and
    from_pretrained re-ties it anyway."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in full:
        return {k: v for k, v in full.items() if k != "lm_head.weight"}
    return full


def export_hf(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Save a Hugging Face checkpoint (safetensors + config + tokenizer with its chat template) to `out_dir`.

    Collective: every rank gathers the full state dict (FSDP2 shards are all-gathered, offloaded to CPU);
    rank 0 writes into ``<out_dir>.tmp-<pid>``, adds :data:`EXPORT_MARKER` and renames it to `out_dir` (replacing
    an older export), so `out_dir` exists only complete. The result loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)``. A full disk raises ``fastpo.storage.DiskFullError`` on
    every rank and leaves no temporary folder.

    A peft LoRA model is exported MERGED (``W + scaling * B @ A`` under the plain model's names, a model that
    needs no peft to load); the adapter alone is saved beside it in ``<out_dir>/adapter`` (``PeftModel`` format).
    The training model is not modified.
    """
    from .model import is_lora, merged_state_dict, unwrap_peft

    out = Path(out_dir)
    tmp = out.with_name(f"{out.name}.tmp-{du.broadcast_object(os.getpid())}")
    options = StateDictOptions(full_state_dict=True, cpu_offload=du.is_distributed())
    full = get_model_state_dict(model, options=options)
    lora = is_lora(model)

    def write() -> None:
        if not du.is_main():
            return
        try:
            with storage.disk_full_as_error(tmp, "Hugging Face export"):
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                storage.inject_disk_full("export", tmp)
                if lora:
                    plain = unwrap_peft(model)
                    plain.save_pretrained(str(tmp), state_dict=_drop_tied_head(plain, merged_state_dict(model, full)),
                                          safe_serialization=True)
                    # save_embedding_layers=False: "auto" would look the base model up (on the hub for a hub id)
                    model.save_pretrained(str(tmp / "adapter"), state_dict=full, safe_serialization=True,
                                          save_embedding_layers=False)
                else:
                    model.save_pretrained(str(tmp), state_dict=_drop_tied_head(model, full), safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
                _write_json(tmp / EXPORT_MARKER, {"complete": True})
                if out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    storage.agree(write)
    du.barrier()
    return out
