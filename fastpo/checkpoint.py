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
    trainer_state.json       {"step", "world_size", "config_hash", "trainer_state": {...}}
    COMPLETE                 written last; a directory without it is never resumed

Multi-node: `run_dir` must be on a filesystem every node sees (each rank writes its own shards there).

Atomicity: everything is written into ``step-000042.tmp-<pid of rank 0>``; after a barrier rank 0 writes
COMPLETE and renames the directory. A crash leaves a ``.tmp-`` directory, which :func:`latest` ignores
and the next save removes.

Models and optimisers go through ``torch.distributed.checkpoint.state_dict`` (get/set_model_state_dict,
get/set_optimizer_state_dict), so FSDP2-sharded parameters and optimiser states round-trip as DTensors
(each rank saves and loads its own shard) and plain modules work in a single process without a process
group. An optimiser is paired with the module in `model_state` that owns its parameters. Anything else
(LR schedulers, ...) only needs ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import distributed as du

MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-(\d+)\.tmp-\d+$")


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


def save(
    run_dir: str | os.PathLike,
    step: int,
    model_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int | None = 3,
    config_hash: str | None = None,
) -> Path:
    """Write ``<run_dir>/checkpoints/step-XXXXXX/`` atomically; every rank must call it (collective).

    Args:
        step: training step (the checkpoint is named after it; re-saving a step replaces it).
        model_state: name -> nn.Module / Optimizer / object with state_dict() and load_state_dict().
        trainer_state: JSON-serialisable trainer state (env seed counters, weight version, ...).
        keep_last: keep this many newest complete checkpoints (None keeps all).
        config_hash: the run's config hash; :func:`resume` refuses a different one.

    Returns:
        The final checkpoint directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    try:  # checked on every rank before any collective, so a bad value cannot strand ranks at a barrier
        json.dumps(trainer_state)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable: {e}") from e
    rank = du.get_rank()
    root = checkpoint_dir(run_dir)
    final = root / step_dir_name(step)
    tmp = root / f"{step_dir_name(step)}.tmp-{du.broadcast_object(os.getpid())}"
    if rank == 0:
        if tmp.exists():  # left by an earlier failed save of this step in this process
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    du.barrier()

    with _single_process_quiet():
        dcp.save(_state_dicts(model_state), checkpoint_id=str(tmp), no_dist=not du.is_distributed())
    _write_json(tmp / _rng_file(rank), du.rng_state())
    if rank == 0:
        meta = {
            "step": step,
            "world_size": du.get_world_size(),
            "config_hash": config_hash,
            "trainer_state": trainer_state,
        }
        _write_json(tmp / TRAINER_STATE_FILE, meta)
    du.barrier()  # every rank's shards and RNG file are on disk

    if rank == 0:
        _write_json(tmp / MARKER, {"step": step})  # last file written, fsynced before the rename
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep_last, step)
    du.barrier()
    return final


def _prune(root: Path, keep_last: int | None, current_step: int) -> None:
    """Remove complete checkpoints beyond the newest `keep_last`, and stale .tmp dirs up to the current step."""
    for d in root.iterdir():
        m = _TMP_DIR.match(d.name)
        if m and int(m.group(1)) <= current_step:
            shutil.rmtree(d, ignore_errors=True)
    if keep_last is None:
        return
    complete = sorted(_complete_steps(root))
    for _step, d in complete[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)


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
    """Newest complete checkpoint (``step-XXXXXX`` with its COMPLETE marker) under `run_dir`, or None.
    ``.tmp-`` directories and directories without the marker are ignored."""
    complete = _complete_steps(checkpoint_dir(run_dir))
    return max(complete)[1] if complete else None


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's trainer_state.json: {"step", "world_size", "config_hash", "trainer_state"}."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    return json.loads((path / TRAINER_STATE_FILE).read_text())


def load(path: str | os.PathLike, model_state: dict[str, Any], restore_rng: bool = True) -> dict[str, Any]:
    """Restore `model_state` in place from the checkpoint at `path` (collective on every rank).

    The objects must have the same structure (and, for FSDP2, the same sharding mesh) as when saved;
    optimisers are restored before their step counters are used. Each rank restores its own RNG state
    when ``restore_rng`` and the checkpoint has a file for this rank (a different world size cannot resume
    the RNG streams exactly: rank 0 prints a note and keeps the current states).

    Returns:
        The saved trainer_state dict.
    """
    path = Path(path)
    meta = read_meta(path)
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
            du.print0(
                f"checkpoint {path.name}: saved with world_size {meta.get('world_size')}, now "
                f"{du.get_world_size()}; RNG states not restored"
            )
    du.barrier()
    return meta["trainer_state"]


def resume(
    run_dir: str | os.PathLike,
    model_state: dict[str, Any],
    mode: str | os.PathLike = "auto",
    config_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any] | None:
    """Load the checkpoint chosen by `mode` into `model_state`; None means start fresh.

    Args:
        mode: "never" (always fresh), "auto" (the newest complete checkpoint under `run_dir`, fresh if none),
            or the path of a checkpoint directory (must be complete).
        config_hash: this run's config hash; a checkpoint saved with a different one is refused
            (ValueError naming both) unless ``force``.

    Returns:
        The saved trainer_state, or None when nothing was loaded.
    """
    if mode == "never":
        return None
    if mode == "auto":
        path = latest(run_dir)
        if path is None:
            return None
    else:
        path = Path(mode)
        if not path.is_dir():
            raise FileNotFoundError(f"resume path {path} does not exist (mode is 'auto', 'never' or a path)")
    meta = read_meta(path)
    saved = meta.get("config_hash")
    if config_hash is not None and saved is not None and saved != config_hash:
        if not force:
            raise ValueError(
                f"checkpoint {path} was saved with config hash {saved}, this run's config hash is {config_hash}; "
                f"pass that run's config (--config <run_dir>/config.json), another --trainer.run_dir, or "
                f"--trainer.resume never"
            )
        du.print0(f"resuming {path} saved with config hash {saved} under config hash {config_hash} (forced)")
    return load(path, model_state)


def export_hf(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike) -> Path:
    """Save a Hugging Face checkpoint (safetensors + config + tokenizer with its chat template) to `out_dir`.

    Collective: every rank gathers the full state dict (FSDP2 shards are all-gathered, offloaded to CPU);
    rank 0 writes. The result loads with ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    A peft LoRA model is exported MERGED (``W + scaling * B @ A`` under the plain model's names, a model that
    needs no peft to load); the adapter alone is saved beside it in ``<out_dir>/adapter`` (``PeftModel`` format).
    The training model is not modified.
    """
    from .model import is_lora, merged_state_dict, unwrap_peft

    out = Path(out_dir)
    options = StateDictOptions(full_state_dict=True, cpu_offload=du.is_distributed())
    full = get_model_state_dict(model, options=options)
    lora = is_lora(model)
    if du.is_main():
        out.mkdir(parents=True, exist_ok=True)
        if lora:
            unwrap_peft(model).save_pretrained(str(out), state_dict=merged_state_dict(model, full),
                                               safe_serialization=True)
            # save_embedding_layers=False: "auto" would look the base model up (on the hub for a hub id)
            model.save_pretrained(str(out / "adapter"), state_dict=full, safe_serialization=True,
                                  save_embedding_layers=False)
        else:
            model.save_pretrained(str(out), state_dict=full, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    du.barrier()
    return out
