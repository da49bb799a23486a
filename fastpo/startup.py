"""Start-up of a training run, the one path both ``python -m fastpo.train`` and a library user's ``Trainer(cfg)``
take (:func:`prepare_run`): every check first (the config, the run directory, the prompt against the tokenizer),
then rank 0 takes ``<run_dir>/.lock`` (one trainer per run directory, released when the run ends), and only then
the first writes: what ``trainer.overwrite`` deletes, the temporary folders of killed writes.

    lock = prepare_run(cfg, world_size)     # ConfigError (nothing written) or the lock (rank 0; None elsewhere)
    ...
    lock.release()
"""

from __future__ import annotations

from .config import Config, ConfigError, config_hash
from .preflight import check_prompt_fits, lora_rank_error, validate
from .storage import RunDirLock, claim_run_dir, lock_run_dir


def _prompt_problem(cfg: Config) -> str | None:
    """The checks that need the model's files, before any model loads: the prompt check
    (``preflight.check_prompt_fits``; this module's name is the patch point for tests) with the run's tokenizer, and
    ``model.lora_rank`` against the model's layers (``preflight.lora_rank_error``, on a meta-device skeleton). The
    problem or None (every rank calls it: resolving ``tiny`` is collective)."""
    from .model import load_tokenizer
    from .model_path import resolve_model_path

    try:
        path = resolve_model_path(cfg.model.path)
        tokenizer = load_tokenizer(path)
    except ValueError as err:  # e.g. a hub id that is not cached while offline: one line, exit 2
        return f"model.path: {err}"
    try:
        check_prompt_fits(cfg, tokenizer)
    except ConfigError as err:
        return str(err)
    return lora_rank_error(cfg, path)


def prepare_run_dir(cfg: Config) -> RunDirLock | None:
    """Every check of the run directory and the config that needs the tokenizer, then the run directory's lock, then
    (only then) the writes: what trainer.overwrite deletes, the temporary folders of killed writes. Collective; one
    ConfigError on every rank for a refusal, with nothing deleted. Returns the lock (rank 0; None elsewhere): release
    it when the run ends."""
    from . import checkpoint, storage

    t = cfg.trainer
    models = {"model.path": cfg.model.path, "model.critic_path": cfg.model.critic_path}
    claim_run_dir(t.run_dir, t.resume, t.overwrite, config_hash(cfg), delete=False, model_paths=models)
    problems = [p for p in storage.all_gather_object(storage.agree(_prompt_problem, cfg)) if p]
    if problems:  # found once the tokenizer is loaded (a prompt that leaves no room for a turn)
        raise ConfigError(problems[0])
    lock = lock_run_dir(t.run_dir)  # a second trainer on this run directory stops here
    try:
        # checked again under the lock (the folder may have changed meanwhile); the first deletion of the run
        claim_run_dir(t.run_dir, t.resume, t.overwrite, config_hash(cfg), delete=True, model_paths=models)
        checkpoint.remove_stale_temp(t.run_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def prepare_run(cfg: Config, world_size: int) -> RunDirLock | None:
    """The one start-up both paths take (``main`` and a library user's ``Trainer(cfg)``): ``preflight.validate``, then
    :func:`prepare_run_dir`. Collective; raises ConfigError (nothing written or deleted). Returns the run
    directory's lock (rank 0; None elsewhere)."""
    validate(cfg, world_size)
    return prepare_run_dir(cfg)
