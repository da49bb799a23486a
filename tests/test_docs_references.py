"""The repository is self-contained: nothing in it points to a document outside it.

Every tracked text file is searched for references to design notes that live elsewhere (``shared/design``, a
"SPEC" section) and for upper-case document names (``FOO.md``) that are neither at the root nor in docs/; every
relative link in a Markdown file must point to a file that exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: (pattern, what to write instead)
FORBIDDEN = (
    (re.compile(r"shared/design"), "a page in docs/"),
    (re.compile(r"\bSPEC\b"), "docs/SEMANTICS.md section N"),
    (re.compile(r"steering repository"), "a page in docs/"),
)
DOC_NAME = re.compile(r"\b[A-Z][A-Z0-9_]*\.md\b")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: files that quote the patterns as examples
SELF = {"tests/test_docs_references.py", "tests/test_docs_commands.py"}
BINARY = (".png", ".so", ".safetensors", ".pt", ".bin", ".jpg")


def tracked_text_files() -> dict[str, str]:
    """{path relative to the root: text} of the files git tracks (all files under the root outside git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, timeout=30,
                             check=True).stdout
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "build", "runs", "__pycache__"}
        paths = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(REPO).parts)]
    files = {}
    for path in paths:
        if path.endswith(BINARY) or not (REPO / path).is_file():
            continue
        try:
            files[path] = (REPO / path).read_text()
        except UnicodeDecodeError:
            continue
    return files


def outside_references(files: dict[str, str], docs: set[str]) -> list[str]:
    """'path:line: problem' for each reference to a document outside the repository. `docs`: the names of the
    existing top-level and docs/ Markdown files."""
    problems = []
    for path, text in sorted(files.items()):
        if path in SELF:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for pattern, instead in FORBIDDEN:
                if pattern.search(line):
                    problems.append(f"{path}:{lineno}: {pattern.pattern!r} (write {instead}): {line.strip()[:120]}")
            for name in DOC_NAME.findall(line):
                if name not in docs:
                    problems.append(f"{path}:{lineno}: {name} is not in the repository: {line.strip()[:120]}")
            if path.endswith(".md"):
                for target in MD_LINK.findall(line):
                    if re.match(r"[a-z]+:|#", target):
                        continue
                    if not (REPO / path).parent.joinpath(target.split("#")[0]).exists():
                        problems.append(f"{path}:{lineno}: link to a missing file {target}")
    return problems


def _doc_names() -> set[str]:
    return {p.name for p in [*REPO.glob("*.md"), *(REPO / "docs").glob("*.md")]}


def test_no_reference_points_outside_the_repository():
    problems = outside_references(tracked_text_files(), _doc_names())
    assert not problems, "references to documents outside the repository:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, found", [
    ("see shared/design/PLATFORM.md", ["'shared/design'", "PLATFORM2.md"]),
    ("(SPEC section 7)", ["'\\\\bSPEC\\\\b'"]),
    ("SPECIAL_TOKENS and docs/SEMANTICS.md section 7", []),
    ("see [the results](RESULTS.md#top) and [it](https://example.com/a.html#b)", []),
    ("see [the results](NOPE.md)", ["NOPE.md is not in the repository", "link to a missing file NOPE.md"]),
])
def test_the_check_finds_what_it_should(text, found):
    text = text.replace("PLATFORM.md", "PLATFORM2.md")  # a name that is certainly not in docs/
    problems = outside_references({"docs/X_TEST.md": text}, {"RESULTS.md", "SEMANTICS.md"})
    assert len(problems) == len(found), problems
    for snippet, problem in zip(found, problems, strict=True):
        assert snippet in problem, (snippet, problem)
