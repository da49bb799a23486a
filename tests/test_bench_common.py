"""bench/common.py refuses to record figures from an uncommitted tree (``--allow-dirty`` marks them instead)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import common  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A one-commit git repository standing in for the checkout (common.REPO)."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "envs.csv").write_text("name\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "init")
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.setenv(common.ALLOW_DIRTY_ENV, "0")  # recorded, so the test's allowance is undone after it
    return tmp_path


ROW = dict(name="n", provider="fastpo", mode="forward", metric="time", unit="s", p50=1.0)


def test_clean_tree_writes_rows_with_the_plain_commit(repo, tmp_path):
    head = _git(repo, "rev-parse", "--short", "HEAD")
    # results are outputs: a changed CSV under bench/results/ leaves the tree clean
    (repo / "bench" / "results" / "envs.csv").write_text("name\nrow\n")
    assert common.uncommitted_files() == []
    assert common.require_clean_tree() == head
    path = common.append_rows("t", [ROW], tmp_path / "out")
    rows = list(csv.DictReader(path.open()))
    assert [r["commit"] for r in rows] == [head]


@pytest.mark.parametrize("change", ["modify", "untracked"])
def test_dirty_tree_is_refused_with_the_files_named(repo, tmp_path, change):
    if change == "modify":
        (repo / "code.py").write_text("x = 2\n")
    else:
        (repo / "new_kernel.py").write_text("y = 1\n")
    name = "code.py" if change == "modify" else "new_kernel.py"
    assert common.uncommitted_files() == [name]
    with pytest.raises(SystemExit, match=f"uncommitted changes \\({name}\\).*--allow-dirty"):
        common.require_clean_tree(allow_dirty=False)
    # a script that skipped the check cannot write unmarked rows either
    with pytest.raises(common.DirtyTreeError, match=r"\+dirty"):
        common.append_rows("t", [ROW], tmp_path / "out")
    assert not (tmp_path / "out" / "t.csv").exists()


def test_allow_dirty_warns_and_stamps_rows(repo, tmp_path, capsys):
    (repo / "code.py").write_text("x = 3\n")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert common.require_clean_tree(allow_dirty=True) == f"{head}+dirty"
    assert "WARNING: benchmarking an uncommitted tree (code.py)" in capsys.readouterr().err
    path = common.append_rows("t", [ROW], tmp_path / "out")
    assert [r["commit"] for r in csv.DictReader(path.open())] == [f"{head}+dirty"]


def test_every_benchmark_script_has_the_flag():
    # each script that appends rows parses --allow-dirty and checks the tree before measuring
    for script in sorted((Path(common.__file__).parent).glob("bench_*.py")):
        text = script.read_text()
        if "append_rows(" in text:
            assert "add_allow_dirty(" in text and "require_clean_tree(" in text, script.name
