"""fastpo.provenance: the git state of a checkout (commit, dirty, changed files) and the run_info.json records the
trainer appends per launch (the trainer side is checked in tests/test_trainer.py's resume and torchrun tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fastpo import provenance


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "checkout"
    (root / "pkg").mkdir(parents=True)
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (root / "pkg" / "code.py").write_text("x = 1\n")
    (root / "out").mkdir()
    (root / "out" / "rows.csv").write_text("a\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "init")
    return root


def test_clean_checkout_reports_its_head(repo):
    state = provenance.source_state(repo)
    assert state == {"commit": _git(repo, "rev-parse", "HEAD"), "short": _git(repo, "rev-parse", "--short", "HEAD"),
                     "dirty": False, "changed": [], "n_changed": 0}
    assert len(state["commit"]) == 40


def test_modified_and_untracked_files_make_it_dirty(repo):
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    (repo / "pkg" / "new.py").write_text("y = 1\n")
    state = provenance.source_state(repo)
    assert state["dirty"] and state["n_changed"] == 2
    assert sorted(state["changed"]) == ["pkg/code.py", "pkg/new.py"]
    # ignored prefixes (benchmark outputs) do not count
    _git(repo, "checkout", "--", "pkg/code.py")
    (repo / "pkg" / "new.py").unlink()
    (repo / "out" / "rows.csv").write_text("a\nb\n")
    assert provenance.source_state(repo, ignore=("out/",))["dirty"] is False
    assert provenance.source_state(repo)["changed"] == ["out/rows.csv"]


def test_changed_list_is_capped_but_counted(repo):
    for i in range(provenance.MAX_CHANGED + 5):
        (repo / f"f{i}.txt").write_text("")
    state = provenance.source_state(repo)
    assert len(state["changed"]) == provenance.MAX_CHANGED and state["n_changed"] == provenance.MAX_CHANGED + 5


def test_not_the_top_of_a_checkout_reports_nothing(repo, tmp_path):
    # a package folder inside someone else's checkout (an install in a venv under it) must not claim its commit
    assert provenance.source_state(repo / "pkg") is None
    outside = tmp_path / "plain"
    outside.mkdir()
    assert provenance.source_state(outside) is None
    assert provenance.uncommitted_files(outside) is None


def test_launch_records_append_and_survive_a_corrupt_file(tmp_path):
    first = provenance.launch_record(world_size=2)
    assert first["world_size"] == 2 and first["start_step"] == 0 and first["torch"]
    provenance.append_launch(tmp_path, first)
    provenance.append_launch(tmp_path, provenance.launch_record(world_size=1, start_step=7))
    launches = json.loads((tmp_path / "run_info.json").read_text())["launches"]
    assert [(r["world_size"], r["start_step"]) for r in launches] == [(2, 0), (1, 7)]
    (tmp_path / "run_info.json").write_text("{not json")
    provenance.append_launch(tmp_path, first)
    assert (tmp_path / "run_info.json.corrupt").read_text() == "{not json"
    assert len(json.loads((tmp_path / "run_info.json").read_text())["launches"]) == 1
    assert not (tmp_path / "run_info.json.tmp").exists()
