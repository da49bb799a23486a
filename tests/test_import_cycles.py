"""No import cycle inside the fastpo namespace, and fastpo.config a leaf.

The graph is read from the source (``ast``), not from a running interpreter, so it holds every import statement
wherever it is: at module level, inside a function (a lazy import that closes a loop at runtime is a cycle too),
``from . import x``, relative imports at any depth, and ``importlib.import_module("fastpo....")`` / ``__import__``
with a literal name. ``fastpo.envs`` and ``fastpo.kernels`` live in envs/ and kernels/ at the repository root and
are mapped into the namespace (setup.py), so they are part of the graph.

An edge goes to the module an import executes: ``from a.b import c`` -> ``a.b.c`` when that is a module, else
``a.b``. A package is not counted as importing its own parent (Python runs the parent's ``__init__`` first, and a
parent that imports its submodules is the normal shape of a package).
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders of the fastpo namespace, by package name.
FASTPO = {"fastpo": ROOT / "fastpo", "fastpo.envs": ROOT / "envs", "fastpo.kernels": ROOT / "kernels"}


def find_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under each package folder."""
    out = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of `modules` (None outside them)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _relative_base(module: str, is_package: bool, level: int) -> str:
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return base


def _import_module_name(node: ast.Call) -> tuple[str, str | None] | None:
    """(name, package) of ``importlib.import_module(NAME[, PACKAGE])`` or ``__import__(NAME)`` with literal
    arguments; None for any other call."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    package = node.args[1] if called == "import_module" and len(node.args) > 1 else next(
        (k.value for k in node.keywords if k.arg == "package"), None)
    package = package.value if isinstance(package, ast.Constant) and isinstance(package.value, str) else None
    return name.value, package


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules of `modules` that `module` (source `path`) imports, with the line of the first such import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(name: str | None, line: int) -> None:
        target = _known(name, modules) if name else None
        parent = module if is_package else module.rpartition(".")[0]
        if target and target != module and not (parent + ".").startswith(target + "."):
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = _relative_base(module, is_package, node.level)
                base = f"{prefix}.{base}" if base else prefix
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno)
        elif isinstance(node, ast.Call) and (called := _import_module_name(node)) is not None:
            name, package = called
            if name.startswith("."):
                if package is None:
                    continue
                level = len(name) - len(name.lstrip("."))
                base = _relative_base(package, True, level)
                name = f"{base}.{name.lstrip('.')}" if name.lstrip(".") else base
            add(name, node.lineno)
    return found


def import_graph(packages: dict[str, Path]) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """(module -> {imported module: line}, module -> file) over every module of `packages`."""
    modules = find_modules(packages)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}, modules


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle ``[a, b, ..., a]`` of `graph`, or None when it has none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """``a -> b (fastpo/a.py:12) -> ...``: each step with the file and line of the import that takes it."""
    base = Path(os.path.commonpath([str(p.parent) for p in modules.values()]))
    steps = [cycle[0]]
    for a, b in zip(cycle, cycle[1:], strict=False):
        steps.append(f"{b} ({modules[a].relative_to(base).as_posix()}:{graph[a][b]})")
    return " -> ".join(steps)


@functools.cache
def _fastpo_graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    return import_graph(FASTPO)


def test_fastpo_has_no_import_cycle():
    graph, modules = _fastpo_graph()
    assert {"fastpo.config", "fastpo.envs.text", "fastpo.kernels.ops"} <= set(modules)
    assert "fastpo.envs" in graph["fastpo.preflight"]  # `from fastpo import envs` reaches the mapped package
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {describe_cycle(cycle, graph, modules)}"


def test_config_imports_nothing_of_fastpo():
    """Every part reads the configuration: it must not be able to break importing it. The config package's modules
    (fastpo.config, .messages, .sections) import each other only."""
    graph, _ = _fastpo_graph()
    package = {m for m in graph if m == "fastpo.config" or m.startswith("fastpo.config.")}
    assert package >= {"fastpo.config", "fastpo.config.messages", "fastpo.config.sections"}, package
    outside = {m: sorted(set(graph[m]) - package) for m in package if set(graph[m]) - package}
    assert outside == {}, outside


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_detector_finds_lazy_relative_and_importlib_cycles(tmp_path):
    """pkg.a -> pkg.b (``from . import b``), pkg.b -> pkg.sub.c (importlib, inside a function), pkg.sub.c -> pkg.a
    (``from ..a import x``, inside a function): a cycle although nothing at module level closes it."""
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "a.py": "from . import b\nx = 1\n",
        "b.py": "def f():\n    import importlib\n    return importlib.import_module('pkg.sub.c')\n",
        "sub/__init__.py": "",
        "sub/c.py": "def g():\n    from ..a import x\n    return x\n",
        "d.py": "import os\nfrom pkg.sub import c\n",  # imports into the cycle, not part of it
    })
    graph, modules = import_graph({"pkg": tmp_path / "pkg"})
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.sub.c": 3}
    assert graph["pkg.sub.c"] == {"pkg.a": 2} and graph["pkg.d"] == {"pkg.sub.c": 2}
    cycle = find_cycle(graph)
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], cycle
    assert describe_cycle(cycle, graph, modules) == ("pkg.a -> pkg.b (a.py:1) -> pkg.sub.c (b.py:3) -> pkg.a "
                                                     "(sub/c.py:2)")

    (tmp_path / "pkg" / "sub" / "c.py").write_text("x = 2\n")  # the loop opened: no cycle
    assert find_cycle(import_graph({"pkg": tmp_path / "pkg"})[0]) is None


def test_the_detector_follows_a_mapped_subpackage(tmp_path):
    """A subpackage kept in another folder (as envs/ is fastpo.envs) takes part in the graph under its mapped name,
    and an import of a parent package's name (``from pkg import ext``) reaches it."""
    _write(tmp_path / "pkg", {"__init__.py": "", "core.py": "def f():\n    from pkg import ext\n"})
    _write(tmp_path / "ext", {"__init__.py": "from .impl import y\n",
                              "impl.py": "import pkg.core as core\ny = 1\n"})
    graph, _ = import_graph({"pkg": tmp_path / "pkg", "pkg.ext": tmp_path / "ext"})
    assert graph["pkg.core"] == {"pkg.ext": 2} and graph["pkg.ext"] == {"pkg.ext.impl": 1}
    assert find_cycle(graph) == ["pkg.core", "pkg.ext", "pkg.ext.impl", "pkg.core"]
