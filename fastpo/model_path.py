"""Where a model loads from: the one resolver of ``model.path`` (and ``model.critic_path``) for train, eval, sft, report
and the loaders in ``fastpo.model``.

    resolve_model_path("tiny")                  # the tiny CPU agent shipped in the package (fastpo.tiny_agent)
    resolve_model_path("runs/demo")             # a fastpo run folder: its finished export, runs/demo/hf
    resolve_model_path("path/to/hf_folder")     # a folder written by save_pretrained, checked for config.json
    resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")          # a hub id: cached, or looked up once (10 s, no retries)
    resolve_model_path(path, "tokenizer")       # the same, the folder checked for the tokenizer's files

Every refusal is one ValueError line naming the path and what to pass: a missing path, a file, a folder without the
files, a run folder without its export (or an export cut short: no COMPLETE marker), a training checkpoint
(``<run>/checkpoints/step-N``: sharded state, not a model), a hub id that is not cached while offline
(``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1``), not found, or with the hub unreachable. Without the up-front
lookup transformers retries each file for ~50 s and ends in a multi-line OSError.
"""

from __future__ import annotations

import functools
import os

#: ``model.path`` placeholder of the tiny CPU agent (the ``tiny`` preset).
TINY_MODEL = "tiny"
#: What a folder must hold for each thing loaded from it: one of these files.
REQUIRED_FILES = {"model": ("config.json",), "tokenizer": ("tokenizer_config.json", "tokenizer.json")}
#: Seconds the one hub lookup of :func:`_hub_problem` may take.
HUB_LOOKUP_TIMEOUT_S = 10.0


def resolve_model_path(path: str | os.PathLike, what: str = "model") -> str:
    """The folder or hub id to pass to ``from_pretrained`` for ``path`` (see the module docstring).

    Args:
        path: ``"tiny"``, a fastpo run folder (or its ``hf/``), a model folder, or a hub id.
        what: ``"model"`` or ``"tokenizer"``: which files a folder must hold (:data:`REQUIRED_FILES`), and the word
            the messages use.

    Returns:
        a folder path (``~`` expanded) or the hub id. Resolving ``"tiny"`` is collective under a process group (rank 0
        builds the agent into the user cache when the package ships none; the other ranks wait).

    Raises:
        ValueError: one line naming the path and what is accepted.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{what} must be a directory path or a hub id (str), got {path!r}")
    if str(path) == TINY_MODEL:
        from . import distributed as du
        from .tiny_agent import tiny_agent_path

        resolved = str(tiny_agent_path()) if du.is_main() else ""
        du.barrier()
        return resolved if du.is_main() else str(tiny_agent_path(build_if_missing=False))
    name = os.path.expanduser(str(path))
    if os.path.isdir(name):
        name = _model_folder(name)
        required = REQUIRED_FILES[what]
        if not any(os.path.exists(os.path.join(name, f)) for f in required):
            raise ValueError(f"{what} directory {name!r} has none of {list(required)}; pass a directory written by "
                             f"save_pretrained")
        return name
    if os.path.exists(name):
        raise ValueError(f"{what} path {name!r} is a file, not a directory; pass the directory written by "
                         "save_pretrained (the folder holding config.json) or a hub id")
    if _looks_like_path(name):
        raise ValueError(f"{what} path {name!r} does not exist; pass a directory written by save_pretrained or a hub "
                         f"id such as Qwen/Qwen2.5-0.5B-Instruct")
    from huggingface_hub import try_to_load_from_cache

    cached = any(isinstance(try_to_load_from_cache(name, f), str) for f in REQUIRED_FILES[what])
    if _offline() and not cached:
        raise ValueError(f"{what} {name!r} is not a local directory and not in the Hugging Face cache while "
                         f"HF_HUB_OFFLINE=1; pass a local directory, or download it first (`hf download {name}`)")
    problem = None if cached or _offline() else _hub_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r} {problem}; accepted: a local model folder, a fastpo run folder, 'tiny' "
                         f"(the tiny CPU agent), or a hub id with the hub reachable (offline: HF_HUB_OFFLINE=1 and the "
                         f"id in the Hugging Face cache)")
    return name


def _model_folder(name: str) -> str:
    """The model folder for folder ``name``: a run folder's ``hf/`` export (it must be finished), the folder itself
    otherwise; ValueError for a run folder without its export and for a training checkpoint."""
    own = os.path.join(name, "config.json")
    if os.path.exists(os.path.join(name, "hf", "config.json")) and not _is_model_config(own):
        return _finished_export(os.path.join(name, "hf"))  # the trainer's export: <run_dir>/hf
    parent = os.path.dirname(os.path.abspath(name))
    if os.path.basename(os.path.abspath(name)) == "hf" and _is_run_config(os.path.join(parent, "config.json")):
        return _finished_export(name)  # <run_dir>/hf given directly
    if os.path.exists(own) and not _is_model_config(own):
        raise ValueError(f"{name!r} is a fastpo run folder without an hf/ export (the run has not finished, or "
                         f"stopped before exporting); pass a finished run, or a model directory")
    if os.path.exists(os.path.join(name, "COMPLETE")) and os.path.exists(os.path.join(name, ".metadata")):
        run = os.path.dirname(os.path.dirname(os.path.abspath(name)))
        raise ValueError(f"{name!r} is a training checkpoint (sharded optimiser and model state), not a model; pass "
                         f"the run folder {run!r} (its hf/ export), or resume the run with --trainer.resume {name}")
    return name


def _finished_export(hf: str) -> str:
    """`hf` when the trainer's export there finished (``fastpo.checkpoint.export_hf`` writes its COMPLETE marker
    last); ValueError naming the folder otherwise."""
    if not os.path.isfile(os.path.join(hf, "COMPLETE")):
        raise ValueError(f"{hf!r} has no COMPLETE marker: an interrupted export (the trainer writes the marker last); "
                         f"pass a run whose export finished, or a model directory")
    return hf


def _read_json(path: str) -> object:
    """The JSON file at `path` (bounded: a deep file is no config), or None when it cannot be read."""
    from .config_io import load_json

    try:
        with open(path, "rb") as f:
            return load_json(f.read(), path)
    except (OSError, ValueError):
        return None


def _is_run_config(path: str) -> bool:
    """True for a fastpo run's config.json (its sections env / rollout / trainer)."""
    data = _read_json(path)
    return isinstance(data, dict) and {"env", "rollout", "trainer"} <= set(data)


def _is_model_config(path: str) -> bool:
    """True for a transformers config.json (it names its ``model_type``); false for a missing file or a fastpo run
    config (sections such as ``trainer``)."""
    data = _read_json(path)
    return isinstance(data, dict) and "model_type" in data


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _looks_like_path(name: str) -> bool:
    """A name no hub id has: absolute, starting with . or ~, more than one /, or an existing path."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name) or os.path.exists(name))


@functools.lru_cache(maxsize=64)
def _hub_problem(name: str) -> str | None:
    """Why hub id `name` (not a folder, not cached) cannot load, from one lookup without retries, or None when it
    exists or the hub answers something else (transformers then reports it). Without this, transformers retries
    each file for ~50 s when the hub cannot be reached and ends in a multi-line OSError."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    try:
        HfApi().repo_info(name, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:  # exists; access is transformers' to report
        return None
    except RepositoryNotFoundError:
        return "was not found on the Hugging Face hub (or is private: log in with `hf auth login`)"
    except HFValidationError:
        return "is not a local directory and not a valid hub id (owner/name)"
    except HfHubHTTPError:
        return None
    except Exception as err:  # DNS, connection refused, timeout: the hub cannot be reached from here
        return f"is not a local directory and the Hugging Face hub cannot be reached ({type(err).__name__})"
    return None
