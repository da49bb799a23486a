"""Every shell command documented in README.md and docs/*.md runs as written (or is skipped with a stated reason).

The commands are the lines of the fenced ``bash`` / ``sh`` / ``shell`` / ``console`` blocks (a trailing ``\\`` joins
lines; a ``#`` comment is dropped; a ``$ `` prompt is removed). They run in order, one doc after another, with bash,
from a scratch folder that mirrors the checkout (symlinks to its top-level entries, its own ``runs/``), with the
test's venv first on PATH: what a user gets after the README's setup line and ``. .venv/bin/activate``.
Under pytest-xdist a doc's commands may land on different workers, each with its own scratch folder: a command
that reads a ``runs/NAME`` folder this worker lacks first gets the earlier command of its doc that writes it
(``--trainer.run_dir``, ``--sft.out`` or ``--out``; see ``producers``). A command that writes run folders runs
once per test session, in the first test that needs it (its own or a reader's); the other workers wait for it and
copy what it wrote (``_run_writer``).

A doc says how its commands are tested with an HTML comment right before the block (invisible on GitHub)::

    <!-- test
    make => skip (runs the whole test suite)
    python -m fastpo.train --help => run
    python -m fastpo.train => slow + --trainer.iterations 1 --env.val_groups 4
    * => + --quick
    -->

One rule a line, ``PREFIX => ACTION``: the first rule whose PREFIX starts the command (spaces normalised; ``*``
matches any) decides. ACTION is ``run`` (as written), ``+ ARGS`` (run with ARGS appended: tiny sizes for a
command that would take minutes) or ``skip (REASON)``; ``slow`` before ``run`` / ``+`` marks the test slow. A
one-line marker ``<!-- test: ACTION -->`` applies to every command of the block. A command that no rule matches
fails without being run: a new command gets a rule saying how it is tested (nothing is started by surprise, e.g. a
`make test` inside the test suite). A rule that matches no command of its block is an error (stale marker).
Each command gets ``TIMEOUT_S``.

Python examples (fenced ``python`` blocks) run only when a one-line marker asks for it: ``<!-- test: python NAME
-->`` runs the whole block, as a script in the same scratch folder, after ``tests/doc_preludes.py``'s ``NAME()``
whose returned dict becomes the block's globals (the objects the surrounding prose says the reader already has: a
model, a dataset, a batch); ``slow python NAME`` marks it slow, ``skip (REASON)`` skips it. Unmarked python blocks
are prose and are not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TIMEOUT_S = 300
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
# the comment that ends right before a block (its body cannot run past its own "-->")
MARKER = re.compile(r"<!--\s*test(?P<body>[\s:](?:(?!-->).)*)-->\s*\Z", re.S)


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int  # 1-based line of the command's first line in the doc
    command: str  # as written, comment stripped, continuation lines joined
    action: str  # "run" | "python" (a python block) | "skip" | "unmarked" (no rule: the test fails)
    extra: str  # appended arguments ("" for none); for "python": the prelude's name
    reason: str  # why it is skipped
    slow: bool

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a ``#`` outside quotes that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, command) of each command in a fenced block's body (first_line: the body's first line)."""
    out, pending, start = [], "", 0
    for offset, raw in enumerate(body.splitlines()):
        text = raw.strip()
        if not pending:
            start = first_line + offset
            text = text[2:] if text.startswith("$ ") else text
        joined = text.endswith("\\")
        text = strip_comment(text[:-1] if joined else text)
        pending = f"{pending} {text}".strip()
        if not joined and pending:
            out.append((start, pending))
            pending = ""
    if pending:
        out.append((start, pending))
    return out


def parse_rules(marker: str) -> list[tuple[str, str]]:
    """[(prefix, action)] of a marker's body (the text after ``<!-- test``); one-line form -> [("*", action)]."""
    body = marker.strip()
    if body.startswith(":"):
        return [("*", body[1:].strip())]
    rules = []
    for line in body.splitlines():
        line = line.strip()
        if not line:
            continue
        if "=>" not in line:
            raise ValueError(f"marker line {line!r} is not 'PREFIX => ACTION'")
        prefix, action = (part.strip() for part in line.split("=>", 1))
        rules.append((" ".join(prefix.split()), action))
    return rules


def parse_action(action: str) -> tuple[str, str, str, bool]:
    """(kind, extra args, skip reason, slow) of a rule's ACTION."""
    slow = action.startswith("slow ")
    action = action[5:].strip() if slow else action
    if action == "run":
        return "run", "", "", slow
    if action.startswith("+ "):
        return "run", action[2:].strip(), "", slow
    match = re.fullmatch(r"python (\w+)", action)
    if match:
        return "python", match.group(1), "", slow
    match = re.fullmatch(r"skip \((.+)\)", action, re.S)
    if match and not slow:
        return "skip", "", match.group(1).strip(), False
    raise ValueError(f"marker action {action!r}: expected 'run', '+ ARGS', 'skip (REASON)', optionally 'slow ...'")


def collect(doc: str, text: str) -> list[DocCommand]:
    """The documented commands of one doc, each with what its marker says."""
    commands = []
    for block in FENCE.finditer(text):
        before = text[: block.start()]
        marker = MARKER.search(before)
        body_line = before.count("\n") + 2
        if block.group("lang") == "python" and marker:
            rules = parse_rules(marker.group("body"))
            if len(rules) != 1 or rules[0][0] != "*":
                raise ValueError(f"{doc}:{body_line - 1}: a python block takes a one-line marker "
                                 "<!-- test: python NAME --> or <!-- test: skip (REASON) -->")
            kind, extra, reason, slow = parse_action(rules[0][1])
            if kind not in ("python", "skip"):
                raise ValueError(f"{doc}:{body_line - 1}: python block marker {rules[0][1]!r}: expected "
                                 "'python NAME' or 'skip (REASON)'")
            commands.append(DocCommand(doc, body_line, block.group("body"), kind, extra, reason, slow))
            continue
        if block.group("lang") not in SHELL_LANGS:
            continue
        rules = parse_rules(marker.group("body")) if marker else []
        used = set()
        for line, command in block_commands(block.group("body"), body_line):
            words = " ".join(command.split())
            rule = next(((p, a) for p, a in rules if p == "*" or words.startswith(p)), None)
            kind, extra, reason, slow = parse_action(rule[1]) if rule else ("unmarked", "", "", False)
            if kind == "python":
                raise ValueError(f"{doc}:{line}: 'python NAME' is for python blocks, not shell commands")
            used.add(rule)
            commands.append(DocCommand(doc, line, command, kind, extra, reason, slow))
        stale = [p for p, a in rules if (p, a) not in used]
        if stale:
            raise ValueError(f"{doc}:{body_line - 1}: marker rules that match no command of the block: {stale}")
    return commands


def all_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in collect(doc, (REPO / doc).read_text())]


def _params():
    for c in all_commands():
        marks = [pytest.mark.slow] if c.slow else []
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder that looks like the checkout (its top-level entries linked) but writes runs/ elsewhere."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in {"runs", ".git"}:
            (root / entry.name).symlink_to(entry)
    return root


@pytest.mark.parametrize("cmd", list(_params()))
def test_documented_command(cmd: DocCommand, workspace: Path, shared_run):
    if cmd.action == "skip":
        pytest.skip(f"{cmd.command!r}: {cmd.reason}")
    if cmd.action == "unmarked":
        pytest.fail(f"{cmd.id}: `{cmd.command}` has no test rule: put a `<!-- test ... -->` marker before its block "
                    "saying `run`, `+ ARGS` (tiny sizes) or `skip (REASON)` (see this test's docstring)")
    for producer in producers(cmd, workspace):  # this worker may not have run them (xdist hands tests out freely)
        _run_writer(producer, workspace, shared_run, why=f"it writes what {cmd.id} reads")
    if writes(cmd):
        _run_writer(cmd, workspace, shared_run)
    else:
        _run_and_check(cmd, workspace)


def _run_writer(cmd: DocCommand, workspace: Path, shared_run, why: str = "") -> None:
    """Run a command that writes run folders once per test session (conftest's shared_run, in the folder every
    pytest-xdist worker shares) and copy what it wrote into this workspace. The first test that needs it (its own,
    or a later command's that reads its folder) runs it here; a test on another worker waits for that run and
    copies, instead of training the same run again."""
    written = writes(cmd)

    def make(folder: Path) -> None:
        _run_and_check(cmd, workspace, why=why)
        for path in written:
            shutil.copytree(workspace / path, folder / path, symlinks=True)

    folder = shared_run(f"docs-{cmd.doc.replace('/', '-')}-{cmd.line}", make)
    for path in written:
        if not (workspace / path).exists():  # made on another worker (or by this one: already here)
            shutil.copytree(folder / path, workspace / path, symlinks=True)


#: where a documented command writes a run folder (train, SFT, the tiny agent's build)
WRITES = re.compile(r"--(?:trainer\.run_dir|sft\.out|out)[ =](runs/[\w.-]+)")
READS = re.compile(r"(?<![\w/.-])(runs/[\w.-]+)")


def writes(cmd: DocCommand) -> list[str]:
    """The run folders a documented command writes (its appended arguments included), sorted, each once."""
    return sorted(set(WRITES.findall(f"{cmd.command} {cmd.extra}")))


def producers(cmd: DocCommand, workspace: Path, commands: list[DocCommand] | None = None) -> list[DocCommand]:
    """The earlier commands of cmd's doc that write the run folders cmd reads and this workspace lacks, in doc order.

    The commands of a doc run in order, but pytest-xdist hands tests to whichever worker is idle, and each worker
    has its own workspace: ``fastpo.eval --model.path runs/demo`` can land on a worker that never trained runs/demo.
    Its producer (the last earlier command that writes runs/demo) then runs first, here, under the same rules.
    """
    commands = all_commands() if commands is None else commands
    earlier = [c for c in commands if c.doc == cmd.doc and c.line < cmd.line and c.action == "run"]
    line = f"{cmd.command} {cmd.extra}"
    wanted = set(READS.findall(line)) - set(writes(cmd))
    out: list[DocCommand] = []
    for path in sorted(wanted):
        if (workspace / path).exists():
            continue
        writer = next((c for c in reversed(earlier) if path in writes(c)), None)
        if writer is not None and writer not in out:
            out.extend(p for p in producers(writer, workspace, commands) if p not in out)
            out.append(writer)
    return sorted(out, key=lambda c: c.line)


def _run_and_check(cmd: DocCommand, workspace: Path, why: str = "") -> None:
    """Run one documented command in the workspace; fail the test with its output if it does not exit 0."""
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "VIRTUAL_ENV":
           str(Path(venv_bin).parent), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    line = f"{cmd.command} {cmd.extra}".strip()
    if cmd.action == "python":  # the block as a script, after its prelude (tests/doc_preludes.py)
        sys.path.insert(0, str(REPO / "tests"))
        import doc_preludes

        missing = [m for m in getattr(doc_preludes, cmd.extra).requires if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"{cmd.id}: needs {', '.join(missing)} (the test peers `make test` installs)")
        script = Path(tempfile.mkdtemp(prefix="doc-python-")) / f"{Path(cmd.doc).stem}_{cmd.line}.py"
        script.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                          f"from doc_preludes import {cmd.extra} as _prelude\n"
                          f"globals().update(_prelude())\n\n{cmd.command}")
        line = f"python {script}"
    label = f"{cmd.id} (run first: {why})" if why else cmd.id
    # its own session, so that a timeout stops the whole tree (torchrun's workers, make's children), not just bash
    proc = subprocess.Popen(["bash", "-c", line], cwd=workspace, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{label}: `{line}` ran over {TIMEOUT_S} s: give it tiny sizes in a `<!-- test -->` marker "
                    "(see this test's docstring)")
    assert proc.returncode == 0, (f"{label}: `{line}` exited {proc.returncode}\n--- stdout\n{stdout[-3000:]}"
                                  f"\n--- stderr\n{stderr[-3000:]}")


# ---- the extraction itself ------------------------------------------------------------------------------------
SAMPLE = """intro
<!-- test
python -m fastpo.train --help => run
python -m fastpo.train => slow + --trainer.iterations 1
make => skip (builds the venv)
-->
```bash
$ python -m fastpo.train --help   # every field
python -m fastpo.train --preset tiny --env.kwargs '{"a": "#not a comment"}' \\
    --trainer.seed 1   # one process
make demo
echo "x"
```

```python
print("not a shell block")
```

<!-- test: skip (needs a GPU) -->
```sh
nvidia-smi
```
"""


def test_extraction_reads_markers_continuations_and_comments():
    got = collect("X.md", SAMPLE)
    assert [(c.line, c.command, c.action, c.extra, c.slow) for c in got] == [
        (8, "python -m fastpo.train --help", "run", "", False),
        (9, "python -m fastpo.train --preset tiny --env.kwargs '{\"a\": \"#not a comment\"}' --trainer.seed 1",
         "run", "--trainer.iterations 1", True),
        (11, "make demo", "skip", "", False),
        (12, 'echo "x"', "unmarked", "", False),  # no rule: the test fails without running it
        (21, "nvidia-smi", "skip", "", False),
    ]
    assert got[2].reason == "builds the venv" and got[4].reason == "needs a GPU"


def test_python_blocks_run_only_when_marked():
    text = ("```python\nprint('prose')\n```\n\n<!-- test: slow python trl_example -->\n```python\nimport x\n"
            "x.run()\n```\n<!-- test: skip (needs a GPU) -->\n```python\ncuda()\n```\n")
    got = collect("X.md", text)
    assert [(c.line, c.command, c.action, c.extra, c.slow) for c in got] == [
        (7, "import x\nx.run()\n", "python", "trl_example", True), (12, "cuda()\n", "skip", "", False)]
    with pytest.raises(ValueError, match="expected 'python NAME'"):
        collect("X.md", "<!-- test: run -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="for python blocks"):
        collect("X.md", "<!-- test: python trl_example -->\n```bash\nx\n```\n")


def test_python_blocks_skipped_as_copies_are_copies():
    """A python block skipped as "the same block as README.md's ..." is, character for character, a README block
    that runs."""
    commands = all_commands()
    readme = {c.command for c in commands if c.doc == "README.md" and c.action == "python"}
    copies = [c for c in commands if c.action == "skip" and c.reason.startswith("the same block as README.md")]
    assert copies and all(c.command in readme for c in copies), [c.id for c in copies if c.command not in readme]


def test_stale_or_malformed_markers_are_errors():
    with pytest.raises(ValueError, match="match no command"):
        collect("X.md", "<!-- test\nfoo => run\n-->\n```bash\nbar\n```\n")
    with pytest.raises(ValueError, match="not 'PREFIX => ACTION'"):
        collect("X.md", "<!-- test\nfoo run\n-->\n```bash\nfoo\n```\n")
    with pytest.raises(ValueError, match="expected 'run'"):
        collect("X.md", "<!-- test: skip because -->\n```bash\nfoo\n```\n")


def test_every_doc_parses_and_has_commands():
    # the docs' markers are well formed, and the README's commands are found (an extraction that finds nothing
    # would pass every doc)
    commands = all_commands()
    readme = [c for c in commands if c.doc == "README.md"]
    assert any("fastpo.train" in c.command for c in readme), [c.command for c in readme]
    assert all(c.action != "skip" or c.reason for c in commands)


def test_a_failing_or_hanging_command_fails_the_test(monkeypatch, tmp_path, shared_run):
    with pytest.raises(AssertionError, match="exited 3"):
        test_documented_command(DocCommand("X.md", 1, "echo out; exit 3", "run", "", "", False), tmp_path, shared_run)
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 1)
    hang = DocCommand("X.md", 2, f"sleep 60 & echo $! > {tmp_path}/child; wait", "run", "", "", False)
    with pytest.raises(pytest.fail.Exception, match="ran over 1 s"):
        test_documented_command(hang, tmp_path, shared_run)
    child = int((tmp_path / "child").read_text())
    for _ in range(50):  # the whole process group was killed, the background child included
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child process {child} outlived the timeout")


CHAIN = """<!-- test
python -m fastpo.train => + --trainer.iterations 1 --trainer.run_dir runs/a
python -m fastpo.sft => run
python -m fastpo.eval => run
python -m fastpo.report => skip (not here)
-->
```bash
python -m fastpo.train --preset tiny
python -m fastpo.sft --model.path runs/a/hf --sft.out runs/b
python -m fastpo.eval --model.path runs/b --config runs/a/config.json
python -m fastpo.report runs/a
```
"""


def test_a_command_whose_run_folder_is_missing_runs_its_writers_first(tmp_path):
    train, sft, evaluate, _ = commands = collect("C.md", CHAIN)
    # a fresh worker: eval needs runs/b (from sft, which needs runs/a from train's appended args) and runs/a
    assert producers(evaluate, tmp_path, commands) == [train, sft]
    assert producers(sft, tmp_path, commands) == [train]
    assert producers(train, tmp_path, commands) == []
    (tmp_path / "runs" / "a").mkdir(parents=True)  # this worker already trained
    assert producers(evaluate, tmp_path, commands) == [sft]
    (tmp_path / "runs" / "b").mkdir()
    assert producers(evaluate, tmp_path, commands) == []


def test_the_readmes_eval_and_report_name_the_run_they_read():
    readme = [c for c in all_commands() if c.doc == "README.md"]
    for command in ("python -m fastpo.eval", "python -m fastpo.report"):
        reader = next(c for c in readme if c.command.startswith(command))
        assert [c.command.split()[0] for c in producers(reader, Path("/nonexistent"), readme)] == ["torchrun"]


def test_a_writer_runs_once_per_session_and_every_workspace_gets_its_folder(tmp_path, shared_run):
    """Two workers' workspaces: the first to need the writer runs it; the second copies its folder."""
    cmd = DocCommand("X.md", 10**6, "mkdir -p runs/x && echo ran >> ../count && echo made > runs/x/f && true", "run",
                     "--out runs/x", "", False)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _run_writer(cmd, a, shared_run)
    _run_writer(cmd, b, shared_run)
    _run_writer(cmd, a, shared_run)  # the same worker again: its folder is there already
    assert (tmp_path / "count").read_text() == "ran\n"
    assert (a / "runs/x/f").read_text() == (b / "runs/x/f").read_text() == "made\n"
